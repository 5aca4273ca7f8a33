"""The page decoder (csrc/arrow/page_decode.cpp): flat numeric, boolean and string columns of
PLAIN or dictionary pages decoded from pyarrow's pages into the same arrays pyarrow's reader
makes, for every writer option that changes the pages (compression, data page v2, dictionary
on/off and its fallback to PLAIN mid-chunk, many small pages, nulls, required columns, 64-bit
offsets); every other column left to pyarrow's reader. The decoder's counters prove which path
each column took, so an equality test cannot pass by never reaching the new code."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_parquet import every_type

from torch_fastload.errors import ParquetDecodeError
from torch_fastload.sources import ParquetDataset, parquet_arena

needs_extension = pytest.mark.skipif(
    parquet_arena.unavailable_reason() is not None,
    reason=f"torch_fastload._arrow is not built: {parquet_arena.unavailable_reason()}",
)

# every_type's columns the page decoder takes; the rest (int8/uint16 widened by pyarrow,
# decimals, duration, float16, lists) are pyarrow's
BY_PAGES = {"i32", "i64", "u64", "f32", "f64", "flag", "ts_us", "ts_ms_tz", "clock", "day64", "day"}
BY_PAGES |= {"name", "blob", "maybe"}

WRITER_OPTIONS = {
    "snappy": dict(compression="snappy"),
    "zstd": dict(compression="zstd"),
    "gzip": dict(compression="gzip"),
    "none": dict(compression="none"),
    "v2-plain-nostats": dict(
        compression="snappy", data_page_version="2.0", use_dictionary=False, write_statistics=False
    ),
    "v2-dictionary": dict(compression="none", data_page_version="2.0"),
    # pages of ~512 bytes and a dictionary that overflows: dictionary pages, then PLAIN ones, in one chunk
    "small-pages-dictionary-fallback": dict(compression="zstd", data_page_size=512, dictionary_pagesize_limit=256),
}


def _decode(path, group, columns, threads=True):
    from torch_fastload import _arrow

    before = _arrow.decode_stats()
    table = _arrow.read_row_group(str(path), group, columns, threads, by_pages=True, into_arena=False)
    after = _arrow.decode_stats()
    return table, {k: after[k] - before[k] for k in after}


@needs_extension
@pytest.mark.parametrize("options", WRITER_OPTIONS.values(), ids=WRITER_OPTIONS.keys())
@pytest.mark.parametrize("threads", [True, False], ids=["column-threads", "one-thread"])
def test_page_decoder_equals_pyarrows_reader(tmp_path, options, threads):
    table = every_type(3000)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=1000, **options)
    reference = pq.ParquetFile(path)
    names = reference.schema_arrow.names
    for group in range(reference.num_row_groups):
        ours, counted = _decode(path, group, list(range(len(names))), threads)
        assert ours.equals(reference.read_row_group(group)), (options, group)
        assert counted["page_columns"] == len(BY_PAGES), counted
        assert counted["fallbacks"] == 0, counted  # no page kind of these writers is left to pyarrow
        assert counted["pyarrow_columns"] == len(names) - len(BY_PAGES)
    for name in names:  # each column alone takes the path the table's did
        _, counted = _decode(path, 0, [names.index(name)], threads)
        assert counted["page_columns"] == (name in BY_PAGES), name


@needs_extension
def test_page_decoder_equals_pyarrow_on_a_polars_file(tmp_path):
    """A second writer: polars (large_string/large_binary in its Arrow schema, its own page
    layout, millisecond timestamps for dates, nanosecond times)."""
    polars = pytest.importorskip("polars")
    table = every_type(3000)
    table = table.select([c for c in table.column_names if c not in ("u16", "u64", "half")])  # not in polars
    path = tmp_path / "polars.parquet"
    polars.from_arrow(table).write_parquet(path, compression="snappy", row_group_size=1000)
    reference = pq.ParquetFile(path)
    assert reference.metadata.created_by.startswith("Polars")
    names = reference.schema_arrow.names
    by_pages = {"i32", "i64", "f32", "f64", "flag", "ts_us", "ts_ms_tz", "clock", "day64", "day", "name", "blob"}
    by_pages.add("maybe")
    for group in range(reference.num_row_groups):
        ours, counted = _decode(path, group, list(range(reference.metadata.num_columns)))
        assert ours.equals(reference.read_row_group(group)), group
        assert counted["page_columns"] == len(by_pages) and counted["fallbacks"] == 0, counted
    assert pa.types.is_large_string(ours.schema.field("name").type)  # 64-bit offsets taken by the decoder
    assert set(names) >= by_pages


@needs_extension
def test_required_columns_large_offsets_and_edge_values(tmp_path):
    """Required (non-nullable) columns carry no definition levels; large_string/large_binary
    take 64-bit offsets; empty strings, all-null columns and null booleans decode as pyarrow's."""
    n = 5000
    rng = np.random.default_rng(1)
    words = [f"w{k}" * int(k % 7) for k in rng.integers(0, 300, n)]  # "" every 7th
    schema = pa.schema(
        [
            pa.field("req_i64", pa.int64(), nullable=False),
            pa.field("req_str", pa.string(), nullable=False),
            pa.field("big_str", pa.large_string()),
            pa.field("big_bin", pa.large_binary()),
            pa.field("all_null", pa.int32()),
            pa.field("null_str", pa.string()),
            pa.field("maybe_flag", pa.bool_()),
            pa.field("f64_dict", pa.float64()),
        ]
    )
    table = pa.table(
        [
            pa.array(rng.integers(0, 10, n)),
            pa.array(words),
            pa.array([None if k % 5 == 0 else w for k, w in enumerate(words)], pa.large_string()),
            pa.array([w.encode() for w in words], pa.large_binary()),
            pa.nulls(n, pa.int32()),
            pa.nulls(n, pa.string()),
            pa.array([None if k % 3 == 0 else bool(k % 2) for k in range(n)]),
            pa.array(rng.integers(0, 4, n).astype(np.float64)),  # four values: dictionary pages
        ],
        schema=schema,
    )
    for k, options in enumerate(WRITER_OPTIONS.values()):
        path = tmp_path / f"edge{k}.parquet"
        pq.write_table(table, path, row_group_size=2000, **options)
        reference = pq.ParquetFile(path)
        for group in range(reference.num_row_groups):
            ours, counted = _decode(path, group, list(range(len(schema))))
            assert ours.equals(reference.read_row_group(group)), (options, group)
            assert counted["page_columns"] == len(schema) and counted["fallbacks"] == 0, (options, counted)


@needs_extension
@pytest.mark.parametrize("dictionary", [True, False], ids=["dictionary", "plain"])
def test_strings_of_every_length_around_the_wide_copies(tmp_path, dictionary):
    """Pages without nulls copy each value 16 bytes at a time, reading and writing past it where
    there is room: lengths 0-80 (every multiple of 16 and one either side), values ending at a
    page's last byte (small pages), the dictionary's last value, 32- and 64-bit offsets."""
    rng = np.random.default_rng(7)
    n = 4000
    pool = [bytes(rng.integers(0, 256, length, dtype=np.uint8)) for length in range(81)]
    values = [pool[int(k)] for k in rng.integers(0, len(pool), n)]
    values[-1] = pool[80]  # the longest value last: its copy ends at the page's (or dictionary's) end
    table = pa.table(
        {
            "bin": pa.array(values, pa.binary()),
            "big": pa.array(values, pa.large_binary()),
            "text": pa.array([v.hex() for v in values], pa.string()),
        },
        schema=pa.schema(
            [
                pa.field(name, t, nullable=False)
                for name, t in [("bin", pa.binary()), ("big", pa.large_binary()), ("text", pa.string())]
            ]
        ),
    )
    for page_size in (300, 1 << 20):
        path = tmp_path / f"s{page_size}.parquet"
        pq.write_table(
            table, path, row_group_size=1500, use_dictionary=dictionary, data_page_size=page_size, compression="none"
        )
        reference = pq.ParquetFile(path)
        for group in range(reference.num_row_groups):
            ours, counted = _decode(path, group, [0, 1, 2])
            assert ours.equals(reference.read_row_group(group)), (page_size, group)
            assert counted["page_columns"] == 3 and counted["fallbacks"] == 0, counted


@needs_extension
def test_row_groups_decode_in_the_order_they_were_asked_for():
    """Column chunks of row groups decoding at once queue by their row group's order, not in
    the pool's arrival order: the first row group (the next batch's) is not finished last with
    the others. Negative control: queued in arrival order, the same tasks run as they came."""
    from torch_fastload import _arrow

    before = pa.cpu_count()
    pa.set_cpu_count(1)  # one pool thread: the queue's order is the order they run
    try:
        asked = [5, 3, 9, 1, 7, 2, 8]
        assert _arrow.ordered_probe(asked) == sorted(asked)
        assert _arrow.ordered_probe(asked, ordered=False) == asked  # FIFO: what it replaced
    finally:
        pa.set_cpu_count(before)


@needs_extension
def test_the_cache_asks_for_row_groups_in_the_samplers_order(tmp_path):
    """Each decode is given an order that grows with the order the cache started it in."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"x": np.arange(8000)}), path, row_group_size=1000)
    dataset = ParquetDataset(path, threads=4)
    cache = dataset._reader()
    seen = []
    decode = cache._decode

    def recorded(index, order=-1):
        seen.append((order, index))
        return decode(index, order)

    cache._decode = recorded
    cache.get([0], ahead=[0, 5, 2, 7])
    cache.get([5, 2, 7])
    started = [index for _, index in sorted(seen)]
    assert started[:4] == [0, 5, 2, 7], seen
    assert all(order >= 0 for order, _ in seen)
    dataset.close()


@needs_extension
def test_dataset_batches_equal_with_either_decoder(tmp_path):
    """ParquetDataset(decoder='pages') gives the batches decoder='pyarrow' does: in order,
    across row groups, shuffled rows."""
    path = tmp_path / "t.parquet"
    pq.write_table(every_type(2500), path, row_group_size=700, compression="snappy")
    pages, reader = ParquetDataset(path, decoder="pages"), ParquetDataset(path, decoder="pyarrow")
    rng = np.random.default_rng(0)
    for indices in (range(0, 1000), range(650, 2500), rng.permutation(2500)[:900]):
        a, b = pages.batch(indices), reader.batch(indices)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and bool((a[key] == b[key]).all()), key
    assert pages._reader().page_decode is not None and reader._reader().page_decode is None


def test_decoder_argument_is_checked(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), path)
    with pytest.raises(ValueError, match="decoder must be one of"):
        ParquetDataset(path, decoder="gpu")


def _corrupt_first_length(path, value: bytes, new_length: int) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(len(value).to_bytes(4, "little") + value)
    data[at : at + 4] = new_length.to_bytes(4, "little")
    path.write_bytes(bytes(data))


@needs_extension
@pytest.mark.parametrize("decoder", ["pages", "pyarrow"])
def test_a_string_running_past_its_page_is_a_typed_error_naming_the_column(tmp_path, decoder):
    """A PLAIN string whose length prefix points past its page: ParquetDecodeError naming the
    file, row group and column, from either decoder (nothing read past the page)."""
    n = 3000
    values = [f"value-{k:06d}" for k in range(n)]
    path = tmp_path / "s.parquet"
    pq.write_table(
        pa.table({"ok": np.arange(n), "s": values}), path, row_group_size=1000, compression="none", use_dictionary=False
    )
    _corrupt_first_length(path, b"value-001500", 1 << 30)  # row group 1
    dataset = ParquetDataset(path, decoder=decoder)
    assert dataset.batch(range(0, 1000))["s__offsets"].shape == (1001,)  # row group 0 is intact
    with pytest.raises(ParquetDecodeError) as caught:
        dataset.batch(range(1000, 2000))
    err = caught.value
    assert err.row_group == 1 and err.column == "s" and str(path) in str(err)
    if decoder == "pages":
        assert "page" in str(err) and "past" in str(err)


@needs_extension
def test_a_dictionary_value_running_past_its_page_is_a_typed_error(tmp_path):
    """A dictionary page whose last value's length points past the page: the page decoder
    refuses it by name rather than reading past the page."""
    from torch_fastload import _arrow

    n = 2000
    path = tmp_path / "d.parquet"
    words = [f"word-{k % 50:03d}" for k in range(n)]
    pq.write_table(pa.table({"w": words}), path, row_group_size=n, compression="none")
    # the dictionary page stores word-000 .. word-049 in order: give word-049's slot a length
    # that swallows the rest of the page, then ask for the page's values
    data = bytearray(path.read_bytes())
    at = data.index((8).to_bytes(4, "little") + b"word-049")
    data[at : at + 4] = (1 << 20).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="dictionary value 49 ends past its page"):
        _arrow.read_row_group(str(path), 0, [0], False, by_pages=True, into_arena=False)
    with pytest.raises(ParquetDecodeError) as caught:
        ParquetDataset(path).batch(range(0, 10))
    assert caught.value.column == "w" and caught.value.row_group == 0


def test_the_loaders_path_says_which_decoder_read_the_columns(tmp_path, monkeypatch):
    """loader.stats().path names the decoder; where the page decoder was asked for and the
    extension is missing, it says so and the batches are the same (pyarrow's reader)."""
    from torch_fastload import DataLoader

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"a": np.arange(1000), "s": [f"v{k}" for k in range(1000)]}), path, row_group_size=300)

    def run(**options):
        loader = DataLoader(ParquetDataset(path, **options), batch_size=256)
        batches = list(loader)
        return batches, loader.stats().path

    reference, said = run(decoder="pyarrow")
    assert "read by pyarrow's reader (decoder='pyarrow')" in said
    _, said = run(read_mode="pread")
    assert "read by pyarrow's reader from each row group's bytes (read_mode='pread')" in said
    if parquet_arena.unavailable_reason() is None:
        batches, said = run()
        assert "decoded by the page decoder" in said
        assert all(bool((b["s"] == r["s"]).all()) for b, r in zip(batches, reference))
    monkeypatch.setattr(parquet_arena, "unavailable_reason", lambda: "not built here")
    monkeypatch.setattr(parquet_arena, "page_decoder", lambda: None)
    batches, said = run()
    assert "the page decoder is not available (not built here)" in said
    assert all(bool((b["a"] == r["a"]).all()) and bool((b["s"] == r["s"]).all()) for b, r in zip(batches, reference))


def _same_values(a: pa.Table, b: pa.Table) -> bool:
    """Tables equal value by value, floats compared by their bits (a damaged double may be a
    NaN, which equals nothing)."""
    if a.schema != b.schema or a.num_rows != b.num_rows:
        return False
    for x, y in zip(a.columns, b.columns):
        x, y = x.combine_chunks(), y.combine_chunks()
        if pa.types.is_floating(x.type):
            bits = {16: pa.int16(), 32: pa.int32(), 64: pa.int64()}[x.type.bit_width]
            x, y = x.view(bits), y.view(bits)
        if not x.equals(y):
            return False
    return True


@needs_extension
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 6])
def test_page_decoder_agrees_with_pyarrow_on_damaged_files(tmp_path, seed):
    """The fuzzer's damaged files (footer bytes, pages, runs), read column chunk by column chunk
    by both decoders: where pyarrow's reader raises, the page decoder raises too, and where it
    reads, the page decoder reads the same values: it neither invents rows from a chunk pyarrow
    refuses nor refuses one pyarrow reads. Chunk by chunk, because pyarrow itself reads a
    damaged list chunk differently alone and beside other columns (pyarrow 25: 202 rows beside
    them, 200 alone), and the page decoder hands such columns to pyarrow alone. A table of other
    rows than the footer's (pyarrow's reader gave 0 of 200 where a page header was damaged) is
    refused by read_row_group whichever decoder made it. The seed picks the writer options
    (v1/v2 pages, dictionary or PLAIN, page size, DELTA_* and BYTE_STREAM_SPLIT pages: seeds 1,
    4 and 6)."""
    import random

    from fuzz_parquet import damage, valid_file

    from torch_fastload import _arrow

    base = tmp_path / "base.parquet"
    valid_file(str(base), seed)
    original = bytearray(base.read_bytes())
    rng = random.Random(seed)
    compared = 0
    for case in range(250):
        data, how = damage(bytearray(original), rng)
        path = tmp_path / f"case{case}.parquet"  # a new name each time: readers are cached by path
        path.write_bytes(bytes(data))
        try:
            meta = pq.ParquetFile(path).metadata
            groups, columns = meta.num_row_groups, meta.num_columns
        except Exception:
            continue  # refused before any page is read: the plan's check, not a decoder's
        for group in range(groups):
            for column in range(columns):
                outcomes = []
                for by_pages in (False, True):
                    try:
                        outcomes.append(_arrow.read_row_group(str(path), group, [column], False, by_pages, False))
                    except (OSError, ValueError) as exc:
                        outcomes.append(exc)
                reference, ours = outcomes
                if isinstance(reference, Exception) or isinstance(ours, Exception):
                    failed = isinstance(reference, Exception) and isinstance(ours, Exception)
                    assert failed, (case, how, group, column, outcomes)
                else:
                    assert _same_values(reference, ours), (case, how, group, column)
                compared += 1
    assert compared > 1000


def _delta_table(n: int = 5000, seed: int = 0) -> tuple[pa.Table, dict]:
    """Columns for the DELTA_* and BYTE_STREAM_SPLIT encodings (nulls in some), and the encoding
    of each (``column_encoding`` of pyarrow's writer; dictionary off)."""
    rng = np.random.default_rng(seed)
    nulls = rng.random(n) < 0.1
    table = pa.table(
        {
            "i32": pa.array(rng.integers(-(2**31), 2**31, n).astype(np.int32)),
            "i64": pa.array([None if z else int(v) for v, z in zip(rng.integers(-(2**62), 2**62, n), nulls)]),
            "seq": pa.array(np.arange(n) * 3 + 10**12),
            "ts": pa.array(np.sort(rng.integers(0, 2**50, n)), pa.timestamp("us")),
            "f32": pa.array(rng.standard_normal(n).astype(np.float32)),
            "f64": pa.array([None if z else float(v) for v, z in zip(rng.standard_normal(n), nulls)]),
            "i32_split": pa.array(rng.integers(-(2**31), 2**31, n).astype(np.int32)),
            "s_lengths": pa.array([None if z else f"v{k % 97}" * (k % 5) for k, z in zip(range(n), nulls)]),
            "s_prefixes": pa.array(sorted(f"prefix-{k:07d}-{'x' * (k % 3)}" for k in range(n))),
            "b_prefixes": pa.array([None if z else (b"ab" * (k % 4)) for k, z in zip(range(n), nulls)], pa.binary()),
        }
    )
    encodings = dict.fromkeys(("i32", "i64", "seq", "ts"), "DELTA_BINARY_PACKED")
    encodings |= dict.fromkeys(("f32", "f64", "i32_split"), "BYTE_STREAM_SPLIT")
    encodings |= {"s_lengths": "DELTA_LENGTH_BYTE_ARRAY"}
    encodings |= dict.fromkeys(("s_prefixes", "b_prefixes"), "DELTA_BYTE_ARRAY")
    return table, encodings


@needs_extension
@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(data_page_version="2.0"),
        dict(data_page_size=700, compression="zstd"),  # many pages: DELTA_BYTE_ARRAY across page boundaries
        dict(data_page_version="2.0", data_page_size=300, compression="snappy"),
    ],
    ids=["v1", "v2", "small-pages-zstd", "v2-small-pages-snappy"],
)
def test_delta_and_byte_stream_split_pages_equal_pyarrows_reader(tmp_path, options):
    """DELTA_LENGTH_BYTE_ARRAY and DELTA_BYTE_ARRAY strings and binaries (the encodings data page
    v2 writers such as parquet-mr pick) are decoded by the page decoder as pyarrow's reader
    does; fixed-width columns of DELTA_BINARY_PACKED or BYTE_STREAM_SPLIT pages go to pyarrow's
    reader from their first page (its SIMD unpacking is ~2x the decoder's), and the table is
    the same."""
    table, encodings = _delta_table()
    path = tmp_path / "delta.parquet"
    pq.write_table(table, path, row_group_size=2000, use_dictionary=False, column_encoding=encodings, **options)
    reference = pq.ParquetFile(path)
    assert set(reference.metadata.row_group(0).column(7).encodings) >= {"DELTA_LENGTH_BYTE_ARRAY"}
    strings = sum(1 for name in encodings if encodings[name].startswith("DELTA_") and "BYTE_ARRAY" in encodings[name])
    for group in range(reference.num_row_groups):
        ours, counted = _decode(path, group, list(range(table.num_columns)))
        assert ours.equals(reference.read_row_group(group)), (options, group)
        assert counted["page_columns"] == strings == 3, counted
        assert counted["fallbacks"] == table.num_columns - strings, counted  # before any page was read
