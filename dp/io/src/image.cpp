// image.cpp — PNG (libpng) and JPEG (libjpeg-turbo) decoding to RGB with PIL's conversions.
// Both libraries report errors through a callback that must not return: ours longjmp back into a
// function that holds nothing with a destructor; the C++ caller owns the decoder and throws.
#include "dp/io/image.h"

#include <algorithm>
#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <memory>

// After <cstdio>: jpeglib.h needs size_t and FILE declared. jerror.h names libjpeg's messages.
#include <jerror.h>
#include <jpeglib.h>
#include <png.h>

#include "dp/runtime/error.h"

namespace dp {
namespace {

constexpr std::uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
// libjpeg-turbo's limit for untrusted progressive JPEGs (tjDecompress's TJFLAG_LIMITSCANS).
constexpr int kMaxJpegScans = 500;

bool starts_with(const std::uint8_t* data, std::size_t size, const void* magic, std::size_t magic_size) {
  return size >= magic_size && std::memcmp(data, magic, magic_size) == 0;
}

// Names a format we recognise but do not decode, so the message says what the file is.
const char* other_format(const std::uint8_t* data, std::size_t size) {
  if (starts_with(data, size, "GIF87a", 6) || starts_with(data, size, "GIF89a", 6)) return "a GIF image";
  if (starts_with(data, size, "BM", 2)) return "a BMP image";
  if (starts_with(data, size, "II*\0", 4) || starts_with(data, size, "MM\0*", 4)) return "a TIFF image";
  if (size >= 12 && starts_with(data, size, "RIFF", 4) && std::memcmp(data + 8, "WEBP", 4) == 0) return "a WebP image";
  if (size >= 2 && data[0] == 'P' && data[1] >= '1' && data[1] <= '7') return "a PNM image";
  return nullptr;
}

void check_pixels(const std::string& name, const char* format, std::uint64_t width, std::uint64_t height,
                  std::uint64_t max_pixels) {
  if (width * height > max_pixels)
    throw DataError(
        fmt::format("{}: {} header claims {} x {} = {} pixels, over the limit of {} (PIL's "
                    "decompression-bomb limit, 2 * MAX_IMAGE_PIXELS): refused before decoding",
                    name, format, width, height, width * height, max_pixels));
}

// ------------------------------------------------------------------------------------------------
// PNG

// What the libpng callbacks share with the decoder; libpng holds a pointer to it.
struct PngInput {
  const std::uint8_t* data = nullptr;
  std::size_t size = 0, at = 0;
  bool truncated = false;
  char message[256] = {};
};

void png_on_error(png_structp png, png_const_charp message) {
  auto* input = static_cast<PngInput*>(png_get_error_ptr(png));
  std::snprintf(input->message, sizeof input->message, "%s", message);
  png_longjmp(png, 1);
}

// libpng's warnings (a bad ancillary chunk, an odd colour profile) leave the pixels intact; PIL
// does not report them either.
void png_on_warning(png_structp, png_const_charp) {}

void png_on_read(png_structp png, png_bytep out, png_size_t length) {
  auto* input = static_cast<PngInput*>(png_get_io_ptr(png));
  if (length > input->size - input->at) {
    input->truncated = true;
    png_error(png, "the data ends early");
  }
  std::memcpy(out, input->data + input->at, length);
  input->at += length;
}

// Owns libpng's structures; the rows libpng writes are C++ memory owned here, outside the function
// libpng longjmps into.
struct PngDecoder {
  PngInput input;
  png_structp png = nullptr;
  png_infop info = nullptr;
  std::vector<std::uint8_t> raw;  // the decoded rows as libpng returns them
  std::vector<png_bytep> rows;
  png_uint_32 width = 0, height = 0;
  int bit_depth = 0, channels = 0;

  PngDecoder(const std::uint8_t* data, std::size_t size) {
    input.data = data;
    input.size = size;
    png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &input, png_on_error, png_on_warning);
    if (png) info = png_create_info_struct(png);
  }
  ~PngDecoder() { png_destroy_read_struct(&png, info ? &info : nullptr, nullptr); }
  PngDecoder(const PngDecoder&) = delete;
  PngDecoder& operator=(const PngDecoder&) = delete;
};

enum class Decoded { done, failed, too_large };

// Every libpng call, under one setjmp: only trivially destructible locals (a longjmp skips
// destructors). Reads the header, checks the pixel count, then decodes into decoder.raw with
// palettes expanded to RGB(A) and low bit depths to 8 bits.
Decoded run_png(PngDecoder& decoder, std::uint64_t max_pixels) {
  png_structp png = decoder.png;
  png_infop info = decoder.info;
  if (setjmp(png_jmpbuf(png))) return Decoded::failed;
  png_set_read_fn(png, &decoder.input, png_on_read);
  // The pixel count is the limit, not libpng's default 1e6 per side (PIL has none).
  png_set_user_limits(png, 0x7fffffff, 0x7fffffff);
  png_read_info(png, info);
  decoder.width = png_get_image_width(png, info);
  decoder.height = png_get_image_height(png, info);
  if (std::uint64_t{decoder.width} * decoder.height > max_pixels) return Decoded::too_large;
  const int color_type = png_get_color_type(png, info);
  if (color_type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color_type == PNG_COLOR_TYPE_GRAY && png_get_bit_depth(png, info) < 8) png_set_expand_gray_1_2_4_to_8(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  decoder.bit_depth = png_get_bit_depth(png, info);
  decoder.channels = png_get_channels(png, info);
  const std::size_t row_bytes = png_get_rowbytes(png, info);
  decoder.raw.resize(row_bytes * decoder.height);
  decoder.rows.resize(decoder.height);
  for (png_uint_32 y = 0; y < decoder.height; ++y) decoder.rows[y] = decoder.raw.data() + y * row_bytes;
  png_read_image(png, decoder.rows.data());
  // Not png_read_end: what follows the pixels (text chunks, IEND) cannot change them, and PIL
  // accepts a file cut after its image data too.
  return Decoded::done;
}

// libpng's rows (1 to 4 channels of 8 or 16 bits) to RGB, as PIL converts them.
void png_rows_to_rgb(const PngDecoder& decoder, Image& image) {
  const std::size_t pixels = std::size_t{decoder.width} * decoder.height;
  const int channels = decoder.channels, bytes = decoder.bit_depth / 8;
  const bool clamp_grey16 = channels == 1 && bytes == 2;  // PIL's mode "I" clipped to 255
  image.rgb.resize(pixels * 3);
  const std::uint8_t* in = decoder.raw.data();
  std::uint8_t* out = image.rgb.data();
  for (std::size_t p = 0; p < pixels; ++p, in += channels * bytes, out += 3) {
    std::uint8_t sample[3];
    for (int c = 0; c < std::min(channels, 3); ++c) {
      const std::uint8_t* s = in + c * bytes;
      sample[c] = clamp_grey16 ? static_cast<std::uint8_t>(std::min(255, (s[0] << 8) | s[1])) : s[0];
    }
    if (channels <= 2) sample[1] = sample[2] = sample[0];  // grey, or grey + alpha
    std::memcpy(out, sample, 3);
  }
}

Image decode_png(const std::uint8_t* data, std::size_t size, const std::string& name, std::uint64_t max_pixels) {
  PngDecoder decoder(data, size);
  if (!decoder.png || !decoder.info) throw DataError(fmt::format("{}: libpng could not start (out of memory)", name));
  switch (run_png(decoder, max_pixels)) {
    case Decoded::done: break;
    case Decoded::too_large: check_pixels(name, "PNG", decoder.width, decoder.height, max_pixels); break;
    case Decoded::failed:
      if (decoder.input.truncated)
        throw DataError(
            fmt::format("{}: truncated PNG: the data ends after {} bytes, before the image does", name, size));
      throw DataError(fmt::format("{}: corrupt PNG ({})", name, decoder.input.message));
  }
  Image image;
  image.width = static_cast<int>(decoder.width);
  image.height = static_cast<int>(decoder.height);
  png_rows_to_rgb(decoder, image);
  return image;
}

// ------------------------------------------------------------------------------------------------
// JPEG

struct JpegErrors {
  jpeg_error_mgr manager;  // first: libjpeg passes &manager, the callbacks cast back to JpegErrors
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {};
  bool truncated = false;
  bool pixels_read = false;  // every scanline is in: the end of the data may now come early
};

void jpeg_on_error(j_common_ptr cinfo) {
  auto* errors = reinterpret_cast<JpegErrors*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, errors->message);
  std::longjmp(errors->jump, 1);
}

// libjpeg's warnings: corrupt entropy-coded data decodes to something, as in PIL, which ignores
// them. The one that matters is the end of the data before the end of the image: libjpeg would
// fill the rest with grey, PIL raises "image file is truncated".
void jpeg_on_message(j_common_ptr cinfo, int level) {
  auto* errors = reinterpret_cast<JpegErrors*>(cinfo->err);
  if (level == -1 && cinfo->err->msg_code == JWRN_JPEG_EOF && !errors->pixels_read) {
    errors->truncated = true;
    jpeg_on_error(cinfo);
  }
}

// A crafted progressive JPEG can hold thousands of scans, each a pass over every coefficient.
void jpeg_on_progress(j_common_ptr cinfo) {
  const auto* dinfo = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (dinfo->input_scan_number > kMaxJpegScans) {
    auto* errors = reinterpret_cast<JpegErrors*>(cinfo->err);
    std::snprintf(errors->message, sizeof errors->message, "more than %d scans", kMaxJpegScans);
    std::longjmp(errors->jump, 1);
  }
}

struct JpegDecoder {
  jpeg_decompress_struct cinfo{};
  JpegErrors errors;
  jpeg_progress_mgr progress{};
  bool created = false;
  JDIMENSION width = 0, height = 0;

  ~JpegDecoder() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
};

// PIL's cmyk2rgb on samples it read inverted ("CMYK;I"): with PIL's C = 255 - c and K = 255 - k
// (c, k as stored), r = (255 - K) - C * (255 - K) / 255 with PIL's MULDIV255 rounding.
std::uint8_t cmyk_channel(std::uint8_t stored_c, std::uint8_t stored_k) {
  const int ink = 255 - stored_c, nk = stored_k;  // PIL's in[c] and 255 - in[3]
  const int product = ink * nk + 128;
  return static_cast<std::uint8_t>(std::clamp(nk - (((product >> 8) + product) >> 8), 0, 255));
}

// Every libjpeg call, under one setjmp: only trivially destructible locals. Reads the header,
// checks the pixel count, then decodes into `image` (RGB, or CMYK converted row by row).
Decoded run_jpeg(JpegDecoder& decoder, const std::uint8_t* data, std::size_t size, std::uint64_t max_pixels,
                 Image& image) {
  jpeg_decompress_struct& cinfo = decoder.cinfo;
  cinfo.err = jpeg_std_error(&decoder.errors.manager);
  decoder.errors.manager.error_exit = jpeg_on_error;
  decoder.errors.manager.emit_message = jpeg_on_message;
  if (setjmp(decoder.errors.jump)) return Decoded::failed;
  jpeg_create_decompress(&cinfo);
  decoder.created = true;
  decoder.progress.progress_monitor = jpeg_on_progress;
  cinfo.progress = &decoder.progress;
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  decoder.width = cinfo.image_width;
  decoder.height = cinfo.image_height;
  if (std::uint64_t{cinfo.image_width} * cinfo.image_height > max_pixels) return Decoded::too_large;
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  jpeg_start_decompress(&cinfo);
  image.width = static_cast<int>(cinfo.output_width);
  image.height = static_cast<int>(cinfo.output_height);
  const std::size_t row_bytes = std::size_t{cinfo.output_width} * 3;
  image.rgb.resize(row_bytes * cinfo.output_height);
  // A CMYK row goes through libjpeg's own image-lifetime pool, freed with the decoder.
  JSAMPARRAY cmyk_row =
      cmyk ? (*cinfo.mem->alloc_sarray)(reinterpret_cast<j_common_ptr>(&cinfo), JPOOL_IMAGE, cinfo.output_width * 4, 1)
           : nullptr;
  while (cinfo.output_scanline < cinfo.output_height) {
    std::uint8_t* out = image.rgb.data() + row_bytes * cinfo.output_scanline;
    if (!cmyk) {
      JSAMPROW row = out;
      jpeg_read_scanlines(&cinfo, &row, 1);
      continue;
    }
    jpeg_read_scanlines(&cinfo, cmyk_row, 1);
    const JSAMPLE* in = cmyk_row[0];
    for (JDIMENSION x = 0; x < cinfo.output_width; ++x, in += 4, out += 3)
      for (int c = 0; c < 3; ++c) out[c] = cmyk_channel(in[c], in[3]);
  }
  decoder.errors.pixels_read = true;
  jpeg_finish_decompress(&cinfo);
  return Decoded::done;
}

Image decode_jpeg(const std::uint8_t* data, std::size_t size, const std::string& name, std::uint64_t max_pixels) {
  JpegDecoder decoder;
  Image image;
  switch (run_jpeg(decoder, data, size, max_pixels, image)) {
    case Decoded::done: break;
    case Decoded::too_large: check_pixels(name, "JPEG", decoder.width, decoder.height, max_pixels); break;
    case Decoded::failed:
      if (decoder.errors.truncated)
        throw DataError(
            fmt::format("{}: truncated JPEG: the data ends after {} bytes, before the image does", name, size));
      throw DataError(fmt::format("{}: corrupt JPEG ({})", name, decoder.errors.message));
  }
  return image;
}

}  // namespace

Image decode_image(const std::uint8_t* data, std::size_t size, const std::string& name, std::uint64_t max_pixels) {
  if (size == 0) throw DataError(fmt::format("{}: empty (0 bytes), not an image", name));
  if (starts_with(data, size, kPngSignature, sizeof kPngSignature)) return decode_png(data, size, name, max_pixels);
  if (size >= 3 && data[0] == 0xff && data[1] == 0xd8 && data[2] == 0xff)
    return decode_jpeg(data, size, name, max_pixels);
  if (const char* format = other_format(data, size))
    throw DataError(fmt::format("{}: {}; only PNG and JPEG are decoded", name, format));
  throw DataError(fmt::format("{}: not an image (neither PNG nor JPEG magic bytes at its start)", name));
}

Image read_image(const std::string& path, std::uint64_t max_pixels) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (status.type() == std::filesystem::file_type::not_found) throw DataError(fmt::format("{}: no such file", path));
  if (ec) throw DataError(fmt::format("{}: cannot read ({})", path, ec.message()));
  // A directory, a FIFO or a device (a link to /dev/zero) would fail oddly, block or never end.
  if (!std::filesystem::is_regular_file(status)) throw DataError(fmt::format("{}: not a regular file", path));
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), std::fclose);
  if (!file) throw DataError(fmt::format("{}: cannot open ({})", path, std::strerror(errno)));
  // Read to the end rather than trusting the size the directory reports (a file being rewritten).
  std::vector<std::uint8_t> bytes;
  constexpr std::size_t kChunk = 1 << 20;
  for (;;) {
    const std::size_t at = bytes.size();
    bytes.resize(at + kChunk);
    const std::size_t got = std::fread(bytes.data() + at, 1, kChunk, file.get());
    bytes.resize(at + got);
    if (got < kChunk) break;
  }
  if (std::ferror(file.get())) throw DataError(fmt::format("{}: read failed ({})", path, std::strerror(errno)));
  return decode_image(bytes.data(), bytes.size(), path, max_pixels);
}

}  // namespace dp
