// Parquet pages decoded straight into Arrow arrays, for the page kinds training tables are made of.
//
// pyarrow's column readers are generic: every value goes through a builder (capacity checks,
// a call per string), which on the alert table costs ~18 ns a string value, and one row group
// of a string column cannot be split across threads. This decoder takes the pages pyarrow's own
// PageReader hands out (page headers, decompression, checksums: all pyarrow's) and decodes the
// common kinds in tight loops: flat columns (no repetition, at most one definition level) of
// fixed-width numbers, booleans and byte arrays, PLAIN or dictionary-encoded, and byte arrays of
// DELTA_LENGTH_BYTE_ARRAY or DELTA_BYTE_ARRAY pages. Anything else (an encoding it does not take
// or that pyarrow decodes faster, a nested field, a type pyarrow converts) is left to pyarrow's
// reader: `decode_column` returns NotImplemented and the caller reads that column the usual way.
#pragma once

#include <arrow/api.h>
#include <parquet/arrow/reader.h>
#include <parquet/file_reader.h>

#include <memory>

namespace fastload_parquet {

// Whether leaf column `column` is one this decoder takes (checked from the footer and the Arrow
// schema pyarrow would produce; the pages may still turn out otherwise, see decode_column).
// On true, `field` is the Arrow field pyarrow gives the column.
bool fast_decodable(const parquet::arrow::FileReader& reader, int column, std::shared_ptr<arrow::Field>* field);

// Leaf column `column` of `row_group`, decoded into buffers from `pool`: the same array pyarrow's
// reader gives. NotImplemented: a page kind this decoder does not take (fall back); Invalid: the
// pages are corrupt (the message says which page and why).
arrow::Result<std::shared_ptr<arrow::Array>> decode_column(parquet::RowGroupReader& row_group, int column,
                                                           const std::shared_ptr<arrow::DataType>& type,
                                                           arrow::MemoryPool* pool);

}  // namespace fastload_parquet
