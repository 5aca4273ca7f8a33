// Header probe of encoded images: format, size, components and the features that decide where
// an image can be decoded (nvJPEG on the GPU, or the CPU), without decoding anything.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tfl {

enum ImageFormat : int64_t { kUnknown = 0, kJpeg = 1, kPng = 2, kGif = 3, kWebp = 4, kBmp = 5 };

// JPEG features that nvJPEG does not decode, or that mark the file as damaged.
enum ImageFlag : int64_t {
  kProgressive = 1,     // SOF2/SOF6: progressive Huffman (nvJPEG decodes it, in software)
  kArithmetic = 2,      // SOF9..SOF15 arithmetic coding
  kLossless = 4,        // SOF3/SOF7/SOF11/SOF15 lossless or hierarchical (SOF5-7, 13-15)
  kHighPrecision = 8,   // sample precision other than 8 bits
  kAdobe = 16,          // an Adobe APP14 segment (CMYK/YCCK colour transform)
};

enum ImageStatus : int64_t {
  kOk = 0,
  kEmpty = 1,       // zero bytes
  kTruncated = 2,   // the file ends before its end-of-image marker (or before its header ends)
  kBadHeader = 3,   // a segment whose length runs past the file, or no frame header at all
};

constexpr int kProbeColumns = 6;  // format, height, width, components, flags, status

// Probe `count` images laid back to back in `data`: image i is [offsets[i], offsets[i+1]).
// Writes kProbeColumns int64 per image to `out`. Never reads outside [data, data + size).
void probe_images(const uint8_t* data, int64_t size, const int64_t* offsets, int64_t count, int64_t* out);

}  // namespace tfl
