// dp/io/image.h — PNG and JPEG files decoded to 8-bit RGB, as torchvision's ImageFolder loader sees
// them: PIL's Image.open(path).convert("RGB") (libpng and libjpeg-turbo underneath).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dp {

struct Image {
  int width = 0, height = 0;
  std::vector<std::uint8_t> rgb;  // (height, width, 3), row-major
};

// PIL's decompression-bomb limit: PIL.Image.MAX_IMAGE_PIXELS (89478485) warns, twice that raises
// DecompressionBombError. Ours refuses what PIL refuses, from the header, before any pixel memory
// is allocated.
inline constexpr std::uint64_t kMaxImagePixels = 2 * std::uint64_t{89478485};

// Decodes a PNG or JPEG image held in memory; the format comes from the magic bytes, never a name.
// `name` is what the error messages call the data (its path). What PIL's convert("RGB") gives:
// - grey (1, 2, 4, 8 bit) is replicated to the three channels, low bit depths scaled to 0..255;
// - a palette is looked up; transparency (tRNS) and alpha channels are dropped, not composited;
// - 16-bit PNG: RGB, RGBA and grey+alpha keep each sample's high byte (PIL's "RGB;16B" raw
//   modes), but 16-bit grey alone clamps to 255 (PIL opens it as mode "I", 0..65535, and convert
//   clips: 0x0080 -> 128, 0x0100 -> 255);
// - CMYK and YCCK JPEGs: PIL reads every CMYK JPEG as inverted (Adobe's convention) and converts
//   with r = (255 - K) - C * (255 - K) / 255 (rounded), i.e. r = k - (255 - c) * k / 255 in the
//   stored values c, k; likewise g and b;
// - ancillary data is ignored: gamma, colour profiles, EXIF orientation (as pil_loader ignores it).
// Throws dp::DataError (exit code 2 in the tools) naming `name` and the problem: empty, not a PNG or JPEG (another
// format is named when recognised), truncated, corrupt (the decoder's message), or more than `max_pixels` pixels. A
// JPEG whose entropy-coded data is damaged but complete decodes as PIL decodes it (libjpeg warns, PIL ignores
// warnings); a JPEG of more than 500 scans is refused (libjpeg-turbo's own limit for untrusted input: each scan
// re-reads the whole coefficient buffer).
Image decode_image(const std::uint8_t* data, std::size_t size, const std::string& name,
                   std::uint64_t max_pixels = kMaxImagePixels);

// Reads and decodes the file at `path`: as decode_image, and a missing path, a directory or an
// unreadable file is an Error naming it.
Image read_image(const std::string& path, std::uint64_t max_pixels = kMaxImagePixels);

}  // namespace dp
