// CPU JPEG decoding of a batch (libjpeg-turbo) straight into planar (3, H, W) uint8 places in
// one pinned buffer, on the engine's thread pool with the GIL released: the share of a batch
// decoded beside nvJPEG costs the training thread no GIL hand-offs (one Python call a batch,
// where a Python thread per image took the GIL ~2 times an image and slowed its launches 2x).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace tfl {

// True where the extension was built against libjpeg (setup.py finds jpeglib.h and -ljpeg).
bool jpeg_decoder_available();
// True where it can decode a region only (libjpeg-turbo's jpeg_crop_scanline/jpeg_skip_scanlines).
bool jpeg_regions_available();

// Rows [top, top + height) x columns [left, left + width) of an image: the part decoded and
// written. A random crop reads ~half of an ImageNet photo: the rows below it are never decoded
// and the columns outside it skip the IDCT and colour conversion. The pixels are a whole
// decode's exactly (the region is decoded with margins: libjpeg treats a cropped scanline's
// first and last columns as image edges when it upsamples chroma).
struct JpegRegion {
  int64_t top = 0, left = 0, height = 0, width = 0;
};

// Image k is the `lengths[k]` bytes at `sources[k]`, of size heights[k] x widths[k]; its
// `regions[k]` is decoded to RGB and written planar (R plane, G plane, B plane) at
// `dst + dst_offsets[k]`, which holds 3 * height * width bytes of the region. Returns one
// message per image: empty where it was decoded, else why not (libjpeg's error, or the size it
// really has); the caller decodes those another way or reports them.
std::vector<std::string> decode_jpegs_planar(const std::vector<const uint8_t*>& sources,
                                             const std::vector<int64_t>& lengths, uint8_t* dst,
                                             const std::vector<int64_t>& dst_offsets,
                                             const std::vector<int64_t>& heights, const std::vector<int64_t>& widths,
                                             const std::vector<JpegRegion>& regions, int num_threads);

// One batch's nvJPEG-able JPEGs split between nvJPEG and the CPU by work stealing: CPU threads
// (run_back) take images from the back, the thread driving nvJPEG claims chunks from the front
// (claim_front), until they meet. Each side gets the share its speed earns, whatever the GPU's
// load (a step that saturates the GPU slows nvJPEG ~4x) or the CPU count.
class JpegSplitJob {
 public:
  JpegSplitJob(std::vector<const uint8_t*> sources, std::vector<int64_t> lengths, uint8_t* dst,
               std::vector<int64_t> dst_offsets, std::vector<int64_t> heights, std::vector<int64_t> widths,
               std::vector<JpegRegion> regions);
  // Decodes from the back on up to num_threads threads of the engine's pool; returns when the
  // two ends have met.
  void run_back(int num_threads);
  // Claims up to `count` images from the front for nvJPEG: [first, last), empty once none is left.
  std::pair<int64_t, int64_t> claim_front(int64_t count);
  // Images [split(), size()) were taken by the CPU side (final once run_back returned).
  int64_t split();
  int64_t size() const { return static_cast<int64_t>(sources_.size()); }
  // One message per image the CPU side took ('' where decoded); empty for nvJPEG's images.
  const std::vector<std::string>& messages() const { return messages_; }

 private:
  int64_t claim_back();

  std::vector<const uint8_t*> sources_;
  std::vector<int64_t> lengths_;
  uint8_t* dst_;
  std::vector<int64_t> dst_offsets_, heights_, widths_;
  std::vector<JpegRegion> regions_;
  std::vector<std::string> messages_;
  std::mutex mu_;
  int64_t front_ = 0, back_ = 0;
};

}  // namespace tfl
