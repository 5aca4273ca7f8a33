// See page_decode.h. Every read of page bytes is bounds-checked: a corrupt page is an Invalid
// status naming the page, never a read past its buffer or a row invented.
#include "page_decode.h"

#include <arrow/util/bit_util.h>
#include <arrow/util/bitmap_ops.h>
#include <parquet/arrow/schema.h>
#include <parquet/column_page.h>
#include <parquet/column_reader.h>
#include <parquet/metadata.h>
#include <parquet/schema.h>
#include <parquet/types.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace fastload_parquet {
namespace {

using arrow::Status;

// An unsigned LEB128 varint of at most `max_bits` bits (RLE run headers are 32-bit, as pyarrow
// reads them; DELTA headers 64-bit).
Status uleb(const uint8_t*& p, const uint8_t* end, uint64_t* v, int max_bits = 64) {
  uint64_t r = 0;
  for (int shift = 0; shift < max_bits; shift += 7) {
    if (p >= end) return Status::Invalid("a varint ends past its page");
    const uint8_t b = *p++;
    r |= uint64_t(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *v = r;
      return Status::OK();
    }
  }
  return Status::Invalid("a varint of more than ", max_bits, " bits");
}

// Bits [at, at + width) of `p` (width <= 64), least significant first; the caller checked they lie
// inside the `bytes` given.
uint64_t bits_at(const uint8_t* p, int64_t bytes, int64_t at, int width) {
  if (width == 0) return 0;
  const int64_t first = at >> 3;
  const int shift = static_cast<int>(at & 7);
  uint64_t low = 0;
  uint8_t high = 0;  // the 9th byte: up to 7 + 64 bits
  if (first + 9 <= bytes) {
    std::memcpy(&low, p + first, 8);
    high = p[first + 8];
  } else {
    uint8_t window[9] = {0};
    std::memcpy(window, p + first, static_cast<size_t>(bytes - first));
    std::memcpy(&low, window, 8);
    high = window[8];
  }
  uint64_t v = low >> shift;
  if (shift && shift + width > 64) v |= uint64_t(high) << (64 - shift);
  return width == 64 ? v : v & ((uint64_t(1) << width) - 1);
}

// The RLE / bit-packed hybrid of the Parquet spec (definition levels, dictionary indices).
class Hybrid {
 public:
  Hybrid(const uint8_t* p, const uint8_t* end, int bit_width) : p_(p), end_(end), width_(bit_width) {}

  // The next `n` values into `out`.
  Status decode(int64_t n, uint32_t* out) {
    while (n > 0) {
      if (repeat_left_ == 0 && packed_left_ == 0) ARROW_RETURN_NOT_OK(next_run());
      if (repeat_left_ > 0) {
        const int64_t take = std::min(n, repeat_left_);
        std::fill(out, out + take, repeat_value_);
        out += take, n -= take, repeat_left_ -= take;
      } else {
        const int64_t take = std::min(n, packed_left_);
        ARROW_RETURN_NOT_OK(unpack(take, out));
        out += take, n -= take, packed_left_ -= take;
      }
    }
    return Status::OK();
  }

  // The next `n` one-bit values (definition levels of a column with one level) as bits of
  // `bitmap` from bit `at`; `ones` gains how many were 1.
  Status decode_bits(int64_t n, uint8_t* bitmap, int64_t at, int64_t* ones) {
    while (n > 0) {
      if (repeat_left_ == 0 && packed_left_ == 0) ARROW_RETURN_NOT_OK(next_run());
      if (repeat_left_ > 0) {
        if (repeat_value_ > 1)
          return Status::Invalid("a run of one-bit values (levels or booleans) holds ", repeat_value_);
        const int64_t take = std::min(n, repeat_left_);
        arrow::bit_util::SetBitsTo(bitmap, at, take, repeat_value_ != 0);
        if (repeat_value_) *ones += take;
        at += take, n -= take, repeat_left_ -= take;
      } else {
        const int64_t take = std::min(n, packed_left_);
        if (packed_at_ + take > packed_bits_) return Status::Invalid("a bit-packed run ends past its page");
        arrow::internal::CopyBitmap(packed_, packed_at_, take, bitmap, at);
        *ones += arrow::internal::CountSetBits(packed_, packed_at_, take);
        packed_at_ += take, at += take, n -= take, packed_left_ -= take;
      }
    }
    return Status::OK();
  }

 private:
  Status next_run() {
    uint64_t header = 0;
    ARROW_RETURN_NOT_OK(uleb(p_, end_, &header, 32));
    if (header & 1) {  // bit-packed: (header >> 1) groups of 8 values
      const int64_t groups = static_cast<int64_t>(header >> 1);
      if (groups == 0) return Status::Invalid("an empty bit-packed run");
      // the whole run inside the page, as pyarrow's reader requires (a damaged header that
      // declares more groups than the page holds is refused, not read into the next runs)
      const int64_t bytes = groups * width_;
      if (bytes > end_ - p_) return Status::Invalid("a bit-packed run of ", groups, " groups ends past its page");
      packed_ = p_, packed_at_ = 0, packed_bits_ = bytes * 8;
      packed_left_ = groups * 8;
      p_ += bytes;
    } else {
      repeat_left_ = static_cast<int64_t>(header >> 1);
      if (repeat_left_ == 0) return Status::Invalid("an empty RLE run");
      const int bytes = (width_ + 7) / 8;
      if (end_ - p_ < bytes) return Status::Invalid("an RLE run's value ends past its page");
      uint32_t v = 0;
      for (int k = 0; k < bytes; ++k) v |= uint32_t(p_[k]) << (8 * k);
      p_ += bytes;
      repeat_value_ = v;
    }
    return Status::OK();
  }

  // Its own loop, not bits_at: dictionary indices are the hot path, and a width of at most 32
  // bits needs one 8-byte load, without bits_at's ninth byte.
  Status unpack(int64_t n, uint32_t* out) {
    if (packed_at_ + n * width_ > packed_bits_) return Status::Invalid("a bit-packed run ends past its page");
    const uint64_t mask = width_ == 32 ? 0xffffffffull : ((1ull << width_) - 1);
    const int64_t bytes = packed_bits_ / 8;
    for (int64_t i = 0; i < n; ++i, packed_at_ += width_) {
      const int64_t byte = packed_at_ >> 3;
      uint64_t word = 0;
      if (byte + 8 <= bytes) {
        std::memcpy(&word, packed_ + byte, 8);
      } else {
        for (int64_t k = byte; k < bytes; ++k) word |= uint64_t(packed_[k]) << (8 * (k - byte));
      }
      out[i] = static_cast<uint32_t>((word >> (packed_at_ & 7)) & mask);
    }
    return Status::OK();
  }

  const uint8_t* p_;
  const uint8_t* end_;
  int width_;
  int64_t repeat_left_ = 0, packed_left_ = 0;
  uint32_t repeat_value_ = 0;
  const uint8_t* packed_ = nullptr;
  int64_t packed_at_ = 0, packed_bits_ = 0;
};

// DELTA_BINARY_PACKED: a header (values a block, miniblocks a block, the value count, the
// first value), then blocks of a minimum delta, each miniblock's bit width and the miniblocks'
// bit-packed deltas. Values wrap around as the column's type does (int32 or int64). Read here for
// the lengths of DELTA_LENGTH_BYTE_ARRAY and DELTA_BYTE_ARRAY pages; fixed-width columns of
// DELTA_BINARY_PACKED or BYTE_STREAM_SPLIT pages are left to pyarrow's reader.
Status zigzag(const uint8_t*& p, const uint8_t* end, int64_t* v) {
  uint64_t u;
  ARROW_RETURN_NOT_OK(uleb(p, end, &u));
  *v = static_cast<int64_t>((u >> 1) ^ (~(u & 1) + 1));
  return Status::OK();
}

// The values of a DELTA_BINARY_PACKED run starting at `p` into `out`: its first `needed` (the
// page's present values), or every one its header counts (`all`: a run of lengths, which the
// bytes follow). `p` is left after the last miniblock read. A header counting fewer values than
// needed is refused; more are allowed, as pyarrow's reader allows them. `bits` (32 or 64): the
// column's integer width.
Status delta_packed(const uint8_t*& p, const uint8_t* end, int64_t needed, int bits, std::vector<int64_t>* out,
                    bool all = false) {
  uint64_t block = 0, miniblocks = 0, total = 0;
  ARROW_RETURN_NOT_OK(uleb(p, end, &block));
  ARROW_RETURN_NOT_OK(uleb(p, end, &miniblocks));
  ARROW_RETURN_NOT_OK(uleb(p, end, &total));
  int64_t value = 0;
  ARROW_RETURN_NOT_OK(zigzag(p, end, &value));
  if (block == 0 || block % 128 || miniblocks == 0 || block % miniblocks || (block / miniblocks) % 32 ||
      miniblocks > 64)
    return Status::Invalid("a DELTA_BINARY_PACKED header of ", block, " values in ", miniblocks, " miniblocks");
  if (block > UINT32_MAX || miniblocks > UINT32_MAX || total > UINT32_MAX)  // 32-bit, as pyarrow reads them
    return Status::Invalid("a DELTA_BINARY_PACKED header past 32 bits");
  // read whole (`all`), a run must fit its bytes: each block takes at least two (its minimum delta
  // and a bit width), so a damaged count is refused before anything is allocated for it
  if (total < static_cast<uint64_t>(needed) ||
      (all && total > static_cast<uint64_t>(end - p) * static_cast<uint64_t>(block) + 1))
    return Status::Invalid("a DELTA_BINARY_PACKED run of ", total, " values where the page holds ", needed);
  const int64_t count = all ? static_cast<int64_t>(total) : needed;
  const int64_t per_miniblock = static_cast<int64_t>(block / miniblocks);
  const uint64_t mask = bits == 32 ? 0xffffffffull : ~0ull;
  auto wrap = [&](uint64_t v) -> int64_t {
    return bits == 32 ? static_cast<int64_t>(static_cast<int32_t>(static_cast<uint32_t>(v))) : static_cast<int64_t>(v);
  };
  out->resize(static_cast<size_t>(count));
  if (count == 0) return Status::OK();
  (*out)[0] = wrap(static_cast<uint64_t>(value));
  int64_t got = 1;
  uint64_t last = static_cast<uint64_t>(value);
  while (got < count) {
    int64_t min_delta = 0;
    ARROW_RETURN_NOT_OK(zigzag(p, end, &min_delta));
    if (end - p < static_cast<int64_t>(miniblocks)) return Status::Invalid("a block's bit widths end past its page");
    const uint8_t* widths = p;
    p += miniblocks;
    for (uint64_t m = 0; m < miniblocks && got < count; ++m) {
      const int width = widths[m];
      if (width > bits) return Status::Invalid("a miniblock of ", width, "-bit deltas in a ", bits, "-bit column");
      const int64_t bytes = per_miniblock * width / 8;
      if (end - p < bytes) return Status::Invalid("a miniblock ends past its page");
      const int64_t take = std::min(per_miniblock, count - got);
      for (int64_t i = 0; i < take; ++i) {
        last = (last + static_cast<uint64_t>(min_delta) + bits_at(p, bytes, i * width, width)) & mask;
        (*out)[got++] = wrap(last);
      }
      p += bytes;
    }
  }
  return Status::OK();
}

enum class Kind { kFixed, kBool, kBytes };

// Bytes a 16-byte value copy may read or write past a value (copy_value).
constexpr int64_t kSlack = 16;

// One column chunk's output, filled page by page.
class ColumnDecoder {
 public:
  ColumnDecoder(Kind kind, int width, bool large_offsets, bool nullable, int64_t rows, int64_t size_hint,
                arrow::MemoryPool* pool)
      : kind_(kind), width_(width), large_(large_offsets), nullable_(nullable), rows_(rows), hint_(size_hint),
        pool_(pool) {}

  Status start() {
    if (nullable_) {
      ARROW_ASSIGN_OR_RAISE(validity_, arrow::AllocateBuffer(arrow::bit_util::BytesForBits(rows_), pool_));
      std::memset(validity_->mutable_data(), 0, validity_->size());
    }
    if (kind_ == Kind::kFixed) {
      ARROW_ASSIGN_OR_RAISE(values_, arrow::AllocateBuffer(rows_ * width_, pool_));
    } else if (kind_ == Kind::kBool) {
      ARROW_ASSIGN_OR_RAISE(values_, arrow::AllocateBuffer(arrow::bit_util::BytesForBits(rows_), pool_));
      std::memset(values_->mutable_data(), 0, values_->size());
    } else {
      ARROW_ASSIGN_OR_RAISE(values_, arrow::AllocateBuffer((rows_ + 1) * (large_ ? 8 : 4), pool_));
      ARROW_ASSIGN_OR_RAISE(data_, arrow::AllocateResizableBuffer(0, pool_));
      ARROW_RETURN_NOT_OK(data_->Reserve(std::max<int64_t>(hint_, 64)));
      set_offset(0, 0);
    }
    return Status::OK();
  }

  Status dictionary(const parquet::Page* page, int32_t count) {
    if (kind_ == Kind::kBool) return Status::NotImplemented("a dictionary of booleans");
    if (count < 0) return Status::Invalid("a dictionary page of ", count, " values");
    // copied: the page reader decompresses every page into one buffer it reuses
    dict_.assign(page->data(), page->data() + page->size()), dict_count_ = count, has_dict_ = true;
    const int64_t size = static_cast<int64_t>(dict_.size());
    dict_.resize(dict_.size() + kSlack, 0);  // read past a value by the 16-byte copies (copy_value)
    const uint8_t* p = dict_.data();
    if (kind_ == Kind::kFixed) {
      if (int64_t(count) * width_ > size)
        return Status::Invalid("a dictionary page of ", count, " values holds only ", size, " bytes");
      return Status::OK();
    }
    dict_start_.resize(count), dict_length_.resize(count);
    int64_t at = 0;
    for (int32_t i = 0; i < count; ++i) {
      uint32_t n;
      if (at + 4 > size) return Status::Invalid("dictionary value ", i, " starts past its page");
      std::memcpy(&n, p + at, 4);
      if (int64_t(n) > size - at - 4) return Status::Invalid("dictionary value ", i, " ends past its page");
      dict_start_[i] = at + 4, dict_length_[i] = n;
      at += 4 + int64_t(n);
    }
    // the rows to come are drawn from this dictionary: room for them at its mean length, so the
    // bytes are not copied at each doubling (the chunk's own size, the first guess, is far less)
    if (count > 0) {
      const int64_t expected = used_ + (rows_ - done_) * ((at - 4 * int64_t(count)) / count + 1);
      if (expected > data_->capacity()) ARROW_RETURN_NOT_OK(data_->Reserve(expected));
    }
    return Status::OK();
  }

  // One data page: `n` rows, its definition levels at `levels` (`levels_end`), values at `values`.
  Status page(int64_t n, const uint8_t* levels, const uint8_t* levels_end, const uint8_t* values,
              const uint8_t* values_end, parquet::Encoding::type encoding) {
    if (n < 0 || done_ + n > rows_) return Status::Invalid("the pages hold more rows than the footer's ", rows_);
    int64_t present = n;
    if (nullable_) {
      present = 0;
      Hybrid defs(levels, levels_end, 1);
      ARROW_RETURN_NOT_OK(defs.decode_bits(n, validity_->mutable_data(), done_, &present));
    }
    if (encoding == parquet::Encoding::PLAIN) {
      ARROW_RETURN_NOT_OK(plain(n, present, values, values_end));
    } else if (encoding == parquet::Encoding::RLE_DICTIONARY || encoding == parquet::Encoding::PLAIN_DICTIONARY) {
      ARROW_RETURN_NOT_OK(indexed(n, present, values, values_end));
    } else if (encoding == parquet::Encoding::RLE && kind_ == Kind::kBool) {  // data page v2's booleans
      ARROW_RETURN_NOT_OK(rle_booleans(n, present, values, values_end));
    } else if (encoding == parquet::Encoding::DELTA_LENGTH_BYTE_ARRAY && kind_ == Kind::kBytes) {
      ARROW_RETURN_NOT_OK(delta_lengths(n, present, values, values_end));
    } else if (encoding == parquet::Encoding::DELTA_BYTE_ARRAY && kind_ == Kind::kBytes) {
      ARROW_RETURN_NOT_OK(delta_strings(n, present, values, values_end));
    } else {
      return Status::NotImplemented("data page encoding ", parquet::EncodingToString(encoding));
    }
    nulls_ += n - present;
    done_ += n;
    return Status::OK();
  }

  arrow::Result<std::shared_ptr<arrow::Array>> finish(const std::shared_ptr<arrow::DataType>& type) {
    if (done_ != rows_) return Status::Invalid("the pages hold ", done_, " rows, the footer says ", rows_);
    std::shared_ptr<arrow::Buffer> validity = nulls_ ? std::shared_ptr<arrow::Buffer>(std::move(validity_)) : nullptr;
    std::vector<std::shared_ptr<arrow::Buffer>> buffers{validity, std::move(values_)};
    if (kind_ == Kind::kBytes) {
      ARROW_RETURN_NOT_OK(data_->Resize(used_, /*shrink_to_fit=*/false));
      buffers.push_back(std::move(data_));
    }
    return arrow::MakeArray(arrow::ArrayData::Make(type, rows_, std::move(buffers), nulls_));
  }

 private:
  bool valid(int64_t row) const { return !nullable_ || arrow::bit_util::GetBit(validity_->data(), row); }
  void set_bool(int64_t row, bool v) { arrow::bit_util::SetBitTo(values_->mutable_data(), row, v); }

  void set_offset(int64_t row, int64_t value) {
    if (large_) {
      reinterpret_cast<int64_t*>(values_->mutable_data())[row] = value;
    } else {
      reinterpret_cast<int32_t*>(values_->mutable_data())[row] = static_cast<int32_t>(value);
    }
  }

  Status append_bytes(const uint8_t* p, int64_t n) {
    if (used_ + n > data_->capacity()) {
      ARROW_RETURN_NOT_OK(data_->Reserve(std::max(used_ + n, 2 * data_->capacity())));
    }
    std::memcpy(data_->mutable_data() + used_, p, static_cast<size_t>(n));
    used_ += n;
    if (!large_ && used_ > INT32_MAX) return Status::NotImplemented("more than 2 GiB of strings for 32-bit offsets");
    return Status::OK();
  }

  Status plain(int64_t n, int64_t present, const uint8_t* p, const uint8_t* end) {
    const int64_t size = end - p;
    if (kind_ == Kind::kFixed) {
      if (present * width_ > size)
        return Status::Invalid("a PLAIN page of ", present, " values holds ", size, " bytes");
      uint8_t* out = values_->mutable_data() + done_ * width_;
      if (present == n) {
        std::memcpy(out, p, static_cast<size_t>(n * width_));
      } else {
        std::memset(out, 0, static_cast<size_t>(n * width_));
        for (int64_t r = 0; r < n; ++r) {
          if (valid(done_ + r)) std::memcpy(out + r * width_, p, width_), p += width_;
        }
      }
      return Status::OK();
    }
    if (kind_ == Kind::kBool) {
      if (arrow::bit_util::BytesForBits(present) > size)
        return Status::Invalid("a PLAIN page of ", present, " booleans holds ", size, " bytes");
      if (present == n) {
        arrow::internal::CopyBitmap(p, 0, n, values_->mutable_data(), done_);
      } else {
        int64_t k = 0;
        for (int64_t r = 0; r < n; ++r) {
          if (valid(done_ + r)) set_bool(done_ + r, arrow::bit_util::GetBit(p, k++));
        }
      }
      return Status::OK();
    }
    if (present == n) return plain_bytes_dense(n, p, end);
    int64_t at = 0;
    for (int64_t r = 0; r < n; ++r) {
      if (valid(done_ + r)) {
        uint32_t length;
        if (at + 4 > size) return Status::Invalid("value ", r, " of a PLAIN page starts past it");
        std::memcpy(&length, p + at, 4);
        if (int64_t(length) > size - at - 4) return Status::Invalid("value ", r, " of a PLAIN page ends past it");
        ARROW_RETURN_NOT_OK(append_bytes(p + at + 4, length));
        at += 4 + int64_t(length);
      }
      set_offset(done_ + r + 1, used_);
    }
    return Status::OK();
  }

  // Room for `bytes` more value bytes and the 16-byte copies' overrun past them.
  Status reserve_values(int64_t bytes) {
    const int64_t need = used_ + bytes + kSlack;
    if (need > data_->capacity()) ARROW_RETURN_NOT_OK(data_->Reserve(std::max(need, 2 * data_->capacity())));
    return Status::OK();
  }

  Status check_offsets_fit() const {
    if (!large_ && used_ > INT32_MAX) return Status::NotImplemented("more than 2 GiB of strings for 32-bit offsets");
    return Status::OK();
  }

  // A PLAIN byte-array page with no nulls: one reservation (its values' bytes are fewer than the
  // page's), then each value copied 16 bytes at a time where the page has room to read past it.
  // Per value, a libc memcpy and a capacity check cost more than the copy of a ~20-byte id.
  Status plain_bytes_dense(int64_t n, const uint8_t* p, const uint8_t* end) {
    const int64_t size = end - p;
    ARROW_RETURN_NOT_OK(reserve_values(size));
    uint8_t* out = data_->mutable_data();
    int64_t at = 0, used = used_;
    auto run = [&](auto* offsets) -> Status {
      for (int64_t r = 0; r < n; ++r) {
        uint32_t length;
        if (at + 4 > size) return Status::Invalid("value ", r, " of a PLAIN page starts past it");
        std::memcpy(&length, p + at, 4);
        if (int64_t(length) > size - at - 4) return Status::Invalid("value ", r, " of a PLAIN page ends past it");
        const uint8_t* from = p + at + 4;
        if (at + 4 + int64_t(length) + kSlack <= size) {
          copy_value(out + used, from, length);
        } else {
          std::memcpy(out + used, from, length);
        }
        used += length;
        at += 4 + int64_t(length);
        offsets[done_ + r + 1] = static_cast<std::remove_pointer_t<decltype(offsets)>>(used);
      }
      return Status::OK();
    };
    const Status st = large_ ? run(reinterpret_cast<int64_t*>(values_->mutable_data()))
                             : run(reinterpret_cast<int32_t*>(values_->mutable_data()));
    used_ = used;
    ARROW_RETURN_NOT_OK(st);
    return check_offsets_fit();
  }

  // A dictionary-encoded byte-array page with no nulls (codes checked): the bytes it makes
  // summed first, one reservation, then the values copied 16 bytes at a time (the dictionary's
  // copy has 16 bytes of slack).
  Status indexed_bytes_dense(int64_t n) {
    int64_t total = 0;
    for (int64_t k = 0; k < n; ++k) total += dict_length_[codes_[k]];
    ARROW_RETURN_NOT_OK(reserve_values(total));
    const uint8_t* dict = dict_.data();
    uint8_t* out = data_->mutable_data();
    int64_t used = used_;
    auto run = [&](auto* offsets) {
      for (int64_t k = 0; k < n; ++k) {
        const uint32_t c = codes_[k];
        const uint32_t length = dict_length_[c];
        copy_value(out + used, dict + dict_start_[c], length);
        used += length;
        offsets[done_ + k + 1] = static_cast<std::remove_pointer_t<decltype(offsets)>>(used);
      }
    };
    if (large_) {
      run(reinterpret_cast<int64_t*>(values_->mutable_data()));
    } else {
      run(reinterpret_cast<int32_t*>(values_->mutable_data()));
    }
    used_ = used;
    return check_offsets_fit();
  }

  // `length` bytes from `from` to `to`, in 16-byte copies: both may be read or written up to 15
  // bytes past `length` (the callers leave kSlack bytes there).
  static void copy_value(uint8_t* to, const uint8_t* from, uint32_t length) {
    for (uint32_t i = 0; i < length; i += kSlack) std::memcpy(to + i, from + i, kSlack);
  }

  // The values of a byte-array page given each one's length, their bytes back to back from `p`.
  Status lengths_then_bytes(int64_t n, const std::vector<int64_t>& lengths, const uint8_t* p, const uint8_t* end) {
    int64_t k = 0;
    for (int64_t r = 0; r < n; ++r) {
      if (valid(done_ + r)) {
        const int64_t length = lengths[k++];
        if (length < 0 || length > end - p) return Status::Invalid("value ", r, " of a page ends past it");
        ARROW_RETURN_NOT_OK(append_bytes(p, length));
        p += length;
      }
      set_offset(done_ + r + 1, used_);
    }
    return Status::OK();
  }

  Status delta_lengths(int64_t n, int64_t present, const uint8_t* p, const uint8_t* end) {
    ARROW_RETURN_NOT_OK(delta_packed(p, end, present, 32, &deltas_, /*all=*/true));
    return lengths_then_bytes(n, deltas_, p, end);
  }

  // DELTA_BYTE_ARRAY: each value is the previous value's first `prefix` bytes, then its suffix
  // (the suffixes a DELTA_LENGTH_BYTE_ARRAY run). The previous value carries over from the
  // page before, as pyarrow's reader keeps it.
  Status delta_strings(int64_t n, int64_t present, const uint8_t* p, const uint8_t* end) {
    std::vector<int64_t> prefixes;
    ARROW_RETURN_NOT_OK(delta_packed(p, end, present, 32, &prefixes, /*all=*/true));
    ARROW_RETURN_NOT_OK(delta_packed(p, end, present, 32, &deltas_, /*all=*/true));
    int64_t k = 0;
    for (int64_t r = 0; r < n; ++r) {
      if (valid(done_ + r)) {
        const int64_t prefix = prefixes[k], suffix = deltas_[k];
        ++k;
        if (prefix < 0 || prefix > static_cast<int64_t>(previous_.size()))
          return Status::Invalid("value ", r, " of a page takes ", prefix, " bytes of a previous value of ",
                                 previous_.size());
        if (suffix < 0 || suffix > end - p) return Status::Invalid("value ", r, " of a page ends past it");
        previous_.resize(static_cast<size_t>(prefix));
        previous_.insert(previous_.end(), p, p + suffix);
        p += suffix;
        ARROW_RETURN_NOT_OK(append_bytes(previous_.data(), static_cast<int64_t>(previous_.size())));
      }
      set_offset(done_ + r + 1, used_);
    }
    return Status::OK();
  }

  // Booleans as a 4-byte length, then the hybrid runs of one-bit values.
  Status rle_booleans(int64_t n, int64_t present, const uint8_t* p, const uint8_t* end) {
    uint32_t length = 0;
    if (end - p < 4) return Status::Invalid("its booleans' length ends past it");
    std::memcpy(&length, p, 4);
    if (int64_t(length) > end - p - 4) return Status::Invalid("its booleans (", length, " bytes) end past it");
    Hybrid bits(p + 4, p + 4 + length, 1);
    int64_t ones = 0;
    if (present == n) return bits.decode_bits(n, values_->mutable_data(), done_, &ones);
    std::vector<uint8_t> dense(static_cast<size_t>(arrow::bit_util::BytesForBits(present)), 0);
    ARROW_RETURN_NOT_OK(bits.decode_bits(present, dense.data(), 0, &ones));
    int64_t k = 0;
    for (int64_t r = 0; r < n; ++r) {
      if (valid(done_ + r)) set_bool(done_ + r, arrow::bit_util::GetBit(dense.data(), k++));
    }
    return Status::OK();
  }

  Status indexed(int64_t n, int64_t present, const uint8_t* p, const uint8_t* end) {
    if (!has_dict_) return Status::Invalid("a dictionary-encoded page and no dictionary page before it");
    if (p >= end) return Status::Invalid("a dictionary-encoded page with no index bit width");
    const int width = *p++;
    if (width > 32) return Status::Invalid("dictionary indices of ", width, " bits");
    codes_.resize(static_cast<size_t>(present));
    Hybrid hybrid(p, end, width);
    ARROW_RETURN_NOT_OK(hybrid.decode(present, codes_.data()));
    for (int64_t k = 0; k < present; ++k) {
      if (codes_[k] >= uint32_t(dict_count_))
        return Status::Invalid("dictionary index ", codes_[k], " of a dictionary of ", dict_count_);
    }
    const uint8_t* dict = dict_.data();
    if (kind_ == Kind::kFixed && present == n && (width_ == 4 || width_ == 8)) {
      if (width_ == 4) {
        gather<uint32_t>(dict, n);
      } else {
        gather<uint64_t>(dict, n);
      }
      return Status::OK();
    }
    if (kind_ == Kind::kFixed) {
      uint8_t* out = values_->mutable_data() + done_ * width_;
      int64_t k = 0;
      for (int64_t r = 0; r < n; ++r, out += width_) {
        if (valid(done_ + r)) {
          std::memcpy(out, dict + int64_t(codes_[k++]) * width_, width_);
        } else {
          std::memset(out, 0, width_);
        }
      }
      return Status::OK();
    }
    if (present == n) return indexed_bytes_dense(n);
    int64_t k = 0;
    for (int64_t r = 0; r < n; ++r) {
      if (valid(done_ + r)) {
        const uint32_t c = codes_[k++];
        ARROW_RETURN_NOT_OK(append_bytes(dict + dict_start_[c], dict_length_[c]));
      }
      set_offset(done_ + r + 1, used_);
    }
    return Status::OK();
  }

  template <typename Word>
  void gather(const uint8_t* dict, int64_t n) {
    const Word* from = reinterpret_cast<const Word*>(dict);  // dict_ is a vector: aligned for any Word
    Word* out = reinterpret_cast<Word*>(values_->mutable_data()) + done_;
    for (int64_t k = 0; k < n; ++k) out[k] = from[codes_[k]];
  }

  Kind kind_;
  int width_;
  bool large_, nullable_;
  int64_t rows_, hint_;
  arrow::MemoryPool* pool_;
  std::unique_ptr<arrow::Buffer> validity_, values_;
  std::unique_ptr<arrow::ResizableBuffer> data_;
  int64_t used_ = 0, done_ = 0, nulls_ = 0;
  std::vector<uint8_t> dict_;
  std::vector<int64_t> deltas_;  // a DELTA_* run's lengths
  std::vector<uint8_t> previous_;  // DELTA_BYTE_ARRAY's previous value
  bool has_dict_ = false;
  int32_t dict_count_ = 0;
  std::vector<int64_t> dict_start_;
  std::vector<uint32_t> dict_length_, codes_;
};

bool unit_matches(const std::shared_ptr<const parquet::LogicalType>& logical, arrow::TimeUnit::type unit) {
  using U = parquet::LogicalType::TimeUnit;
  U::unit want = unit == arrow::TimeUnit::MILLI   ? U::MILLIS
                 : unit == arrow::TimeUnit::MICRO ? U::MICROS
                 : unit == arrow::TimeUnit::NANO  ? U::NANOS
                                                  : U::UNKNOWN;
  if (logical->is_timestamp()) return static_cast<const parquet::TimestampLogicalType&>(*logical).time_unit() == want;
  if (logical->is_time()) return static_cast<const parquet::TimeLogicalType&>(*logical).time_unit() == want;
  return false;
}

bool int_matches(const std::shared_ptr<const parquet::LogicalType>& logical, int bits, bool is_signed) {
  if (logical->is_none()) return is_signed;
  if (!logical->is_int()) return false;
  const auto& i = static_cast<const parquet::IntLogicalType&>(*logical);
  return i.bit_width() == bits && i.is_signed() == is_signed;
}

// The decoder's kind for a column, or false where pyarrow converts values (or it is not flat).
bool kind_of(const parquet::ColumnDescriptor& d, const arrow::DataType& type, Kind* kind, int* width) {
  if (d.max_repetition_level() != 0 || d.max_definition_level() > 1) return false;
  const auto& logical = d.logical_type();
  using T = arrow::Type;
  switch (d.physical_type()) {
    case parquet::Type::BOOLEAN:
      *kind = Kind::kBool, *width = 0;
      return type.id() == T::BOOL;
    case parquet::Type::INT32:
      *kind = Kind::kFixed, *width = 4;
      switch (type.id()) {
        case T::INT32: return int_matches(logical, 32, true);
        case T::UINT32: return int_matches(logical, 32, false);
        case T::DATE32: return logical->is_date();
        case T::TIME32: return unit_matches(logical, static_cast<const arrow::Time32Type&>(type).unit());
        default: return false;
      }
    case parquet::Type::INT64:
      *kind = Kind::kFixed, *width = 8;
      switch (type.id()) {
        case T::INT64: return int_matches(logical, 64, true);
        case T::UINT64: return int_matches(logical, 64, false);
        case T::TIMESTAMP: return unit_matches(logical, static_cast<const arrow::TimestampType&>(type).unit());
        case T::TIME64: return unit_matches(logical, static_cast<const arrow::Time64Type&>(type).unit());
        default: return false;
      }
    case parquet::Type::FLOAT:
      *kind = Kind::kFixed, *width = 4;
      return type.id() == T::FLOAT && logical->is_none();
    case parquet::Type::DOUBLE:
      *kind = Kind::kFixed, *width = 8;
      return type.id() == T::DOUBLE && logical->is_none();
    case parquet::Type::BYTE_ARRAY:
      *kind = Kind::kBytes, *width = 0;
      switch (type.id()) {
        case T::STRING:
        case T::LARGE_STRING: return logical->is_string() || logical->is_none();
        case T::BINARY:
        case T::LARGE_BINARY: return logical->is_none();
        default: return false;
      }
    default:
      return false;
  }
}

}  // namespace

bool fast_decodable(const parquet::arrow::FileReader& reader, int column, std::shared_ptr<arrow::Field>* field) {
  const auto& manifest = reader.manifest();
  const parquet::arrow::SchemaField* sf = nullptr;
  if (!manifest.GetColumnField(column, &sf).ok() || sf == nullptr || !sf->children.empty()) return false;
  if (manifest.GetParent(sf) != nullptr || sf->field == nullptr) return false;
  const parquet::ColumnDescriptor* d = reader.parquet_reader()->metadata()->schema()->Column(column);
  Kind kind;
  int width;
  if (!kind_of(*d, *sf->field->type(), &kind, &width)) return false;
  *field = sf->field;
  return true;
}

arrow::Result<std::shared_ptr<arrow::Array>> decode_column(parquet::RowGroupReader& row_group, int column,
                                                           const std::shared_ptr<arrow::DataType>& type,
                                                           arrow::MemoryPool* pool) {
  const parquet::ColumnDescriptor* d = row_group.metadata()->schema()->Column(column);
  Kind kind;
  int width;
  if (!kind_of(*d, *type, &kind, &width)) return Status::NotImplemented("column type");
  const auto chunk = row_group.metadata()->ColumnChunk(column);
  if (chunk->type() != d->physical_type())  // a corrupt footer: refused as pyarrow's reader does
    return Status::Invalid("column '", d->path()->ToDotString(), "': its chunk's metadata says type ",
                           parquet::TypeToString(chunk->type()), ", its schema ",
                           parquet::TypeToString(d->physical_type()));
  const bool large = type->id() == arrow::Type::LARGE_STRING || type->id() == arrow::Type::LARGE_BINARY;
  const bool nullable = d->max_definition_level() == 1;
  const int64_t rows = row_group.metadata()->num_rows();
  const int64_t hint = chunk->total_uncompressed_size();
  if (kind == Kind::kFixed) {  // pyarrow's SIMD unpacking decodes these ~2x faster (JOURNAL.md)
    for (parquet::Encoding::type e : chunk->encodings()) {
      if (e == parquet::Encoding::DELTA_BINARY_PACKED || e == parquet::Encoding::BYTE_STREAM_SPLIT)
        return Status::NotImplemented("fixed-width ", parquet::EncodingToString(e), " pages");
    }
  }
  ColumnDecoder out(kind, width, large, nullable, rows, hint, pool);
  ARROW_RETURN_NOT_OK(out.start());
  std::unique_ptr<parquet::PageReader> pages = row_group.GetColumnPageReader(column);
  int index = 0;
  for (std::shared_ptr<parquet::Page> page = pages->NextPage(); page; page = pages->NextPage(), ++index) {
    Status st;
    const uint8_t* data = page->data();
    const uint8_t* end = data + page->size();
    switch (page->type()) {
      case parquet::PageType::DICTIONARY_PAGE: {
        const auto& dict = static_cast<const parquet::DictionaryPage&>(*page);
        if (dict.encoding() != parquet::Encoding::PLAIN && dict.encoding() != parquet::Encoding::PLAIN_DICTIONARY)
          return Status::NotImplemented("dictionary page encoding");
        st = out.dictionary(page.get(), dict.num_values());
        break;
      }
      case parquet::PageType::DATA_PAGE: {
        const auto& v1 = static_cast<const parquet::DataPageV1&>(*page);
        const uint8_t* levels = data;
        const uint8_t* levels_end = data;
        if (nullable) {
          if (v1.definition_level_encoding() != parquet::Encoding::RLE)
            return Status::NotImplemented("definition level encoding");
          uint32_t n = 0;
          if (end - data < 4) {
            st = Status::Invalid("its definition levels' length ends past it");
            break;
          }
          std::memcpy(&n, data, 4);
          if (int64_t(n) > end - data - 4) {
            st = Status::Invalid("its definition levels (", n, " bytes) end past it");
            break;
          }
          levels = data + 4, levels_end = levels + n;
        }
        st = out.page(v1.num_values(), levels, levels_end, levels_end, end, v1.encoding());
        break;
      }
      case parquet::PageType::DATA_PAGE_V2: {
        const auto& v2 = static_cast<const parquet::DataPageV2&>(*page);
        const int64_t def = v2.definition_levels_byte_length(), rep = v2.repetition_levels_byte_length();
        if (rep != 0 || def < 0 || def > end - data) {
          st = Status::Invalid("its level lengths (", rep, ", ", def, ") do not fit a flat column of ", page->size(),
                               " bytes");
          break;
        }
        st = out.page(v2.num_values(), data, data + def, data + def, end, v2.encoding());
        break;
      }
      default:
        break;  // index pages and unknown kinds carry no values
    }
    if (!st.ok()) {
      if (st.IsNotImplemented()) return st;
      return st.WithMessage("column '", d->path()->ToDotString(), "', page ", index, ": ", st.message());
    }
  }
  auto result = out.finish(type);
  if (!result.ok() && result.status().IsInvalid())
    return result.status().WithMessage("column '", d->path()->ToDotString(), "': ", result.status().message());
  return result;
}

}  // namespace fastload_parquet
