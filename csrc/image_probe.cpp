#include "image_probe.h"

#include <cstring>

namespace tfl {
namespace {

inline int64_t be16(const uint8_t* p) { return (int64_t(p[0]) << 8) | p[1]; }
inline int64_t be32(const uint8_t* p) { return (be16(p) << 16) | be16(p + 2); }
inline int64_t le16(const uint8_t* p) { return int64_t(p[0]) | (int64_t(p[1]) << 8); }
inline int64_t le32(const uint8_t* p) { return le16(p) | (le16(p + 2) << 16); }

struct Info {
  int64_t format = kUnknown, height = 0, width = 0, components = 0, flags = 0, status = kOk;
};

// After a scan header, entropy-coded data runs to the next marker that is not a stuffed 0xFF00
// or a restart marker. Returns the offset of that marker's 0xFF, or n if the data ends first.
int64_t skip_entropy_data(const uint8_t* p, int64_t n, int64_t i) {
  while (i < n) {
    const void* ff = std::memchr(p + i, 0xFF, static_cast<size_t>(n - i));
    if (ff == nullptr) return n;
    i = static_cast<const uint8_t*>(ff) - p;
    if (i + 1 >= n) return n;
    const uint8_t next = p[i + 1];
    if (next == 0x00 || (next >= 0xD0 && next <= 0xD7) || next == 0xFF) {
      i += (next == 0xFF) ? 1 : 2;  // stuffing, restart marker, or fill bytes before a marker
      continue;
    }
    return i;
  }
  return n;
}

Info probe_jpeg(const uint8_t* p, int64_t n) {
  Info info;
  info.format = kJpeg;
  bool have_frame = false;
  int64_t i = 2;
  while (true) {
    if (i >= n) { info.status = kTruncated; return info; }  // no end-of-image marker
    if (p[i] != 0xFF) {  // garbage between segments: libjpeg tolerates it, so do we, by resyncing
      const void* ff = std::memchr(p + i, 0xFF, static_cast<size_t>(n - i));
      if (ff == nullptr) { info.status = kTruncated; return info; }
      i = static_cast<const uint8_t*>(ff) - p;
      continue;
    }
    while (i < n && p[i] == 0xFF) ++i;  // fill bytes
    if (i >= n) { info.status = kTruncated; return info; }
    const uint8_t marker = p[i++];
    if (marker == 0xD9) {  // EOI
      if (!have_frame) info.status = kBadHeader;
      return info;
    }
    if (marker == 0xD8 || marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7)) continue;  // no length
    if (i + 2 > n) { info.status = kTruncated; return info; }
    const int64_t length = be16(p + i);
    if (length < 2) { info.status = kBadHeader; return info; }
    if (i + length > n) { info.status = kTruncated; return info; }
    const uint8_t* seg = p + i + 2;
    const int64_t seg_len = length - 2;
    const bool is_sof = marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
    if (is_sof && !have_frame) {
      if (seg_len < 6) { info.status = kBadHeader; return info; }
      have_frame = true;
      if (seg[0] != 8) info.flags |= kHighPrecision;
      info.height = be16(seg + 1);
      info.width = be16(seg + 3);
      info.components = seg[5];
      if (marker == 0xC2 || marker == 0xC6 || marker == 0xCA || marker == 0xCE) info.flags |= kProgressive;
      if (marker >= 0xC9) info.flags |= kArithmetic;
      if (marker == 0xC3 || (marker >= 0xC5 && marker <= 0xC7) || marker == 0xCB || marker >= 0xCD)
        info.flags |= kLossless;
    } else if (marker == 0xEE && seg_len >= 5 && std::memcmp(seg, "Adobe", 5) == 0) {
      info.flags |= kAdobe;
    }
    i += length;
    if (marker == 0xDA) {  // start of scan: skip its entropy-coded data to the next marker
      if (!have_frame) { info.status = kBadHeader; return info; }
      i = skip_entropy_data(p, n, i);
    }
  }
}

Info probe_one(const uint8_t* p, int64_t n) {
  Info info;
  if (n <= 0) { info.status = kEmpty; return info; }
  if (n >= 3 && p[0] == 0xFF && p[1] == 0xD8 && p[2] == 0xFF) return probe_jpeg(p, n);
  static const uint8_t kPngMagic[8] = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  if (n >= 8 && std::memcmp(p, kPngMagic, 8) == 0) {
    info.format = kPng;
    if (n < 26 || std::memcmp(p + 12, "IHDR", 4) != 0) { info.status = n < 26 ? kTruncated : kBadHeader; return info; }
    info.width = be32(p + 16);
    info.height = be32(p + 20);
    const int64_t color_type = p[25];
    info.components = color_type == 0 ? 1 : color_type == 2 ? 3 : color_type == 3 ? 3 : color_type == 4 ? 2 : 4;
    if (p[24] != 8) info.flags |= kHighPrecision;
    // A PNG ends with an IEND chunk: 12 bytes, "IEND" at 4 from the chunk start.
    if (n < 45 || std::memcmp(p + n - 8, "IEND", 4) != 0) info.status = kTruncated;
    return info;
  }
  if (n >= 6 && (std::memcmp(p, "GIF87a", 6) == 0 || std::memcmp(p, "GIF89a", 6) == 0)) {
    info.format = kGif;
    if (n < 10) { info.status = kTruncated; return info; }
    info.width = le16(p + 6);
    info.height = le16(p + 8);
    info.components = 3;
    return info;
  }
  if (n >= 12 && std::memcmp(p, "RIFF", 4) == 0 && std::memcmp(p + 8, "WEBP", 4) == 0) {
    info.format = kWebp;
    if (le32(p + 4) + 8 > n) info.status = kTruncated;
    return info;
  }
  if (n >= 2 && p[0] == 'B' && p[1] == 'M') {
    info.format = kBmp;
    if (n >= 26) {
      info.width = le32(p + 18);
      info.height = le32(p + 22);
      if (info.height >= (int64_t(1) << 31)) info.height = (int64_t(1) << 32) - info.height;  // top-down rows
    }
    if (n < 14 || le32(p + 2) > n) info.status = kTruncated;
    return info;
  }
  info.status = kBadHeader;
  return info;
}

}  // namespace

void probe_images(const uint8_t* data, int64_t size, const int64_t* offsets, int64_t count, int64_t* out) {
  for (int64_t k = 0; k < count; ++k) {
    int64_t begin = offsets[k], end = offsets[k + 1];
    Info info;
    if (begin < 0 || end < begin || end > size) {
      info.status = kBadHeader;
    } else {
      info = probe_one(data + begin, end - begin);
    }
    int64_t* row = out + k * kProbeColumns;
    row[0] = info.format;
    row[1] = info.height;
    row[2] = info.width;
    row[3] = info.components;
    row[4] = info.flags;
    row[5] = info.status;
  }
}

}  // namespace tfl
