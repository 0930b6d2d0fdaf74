// image_files.h — PNG and JPEG files for tests, written with libpng and libjpeg-turbo (the decoders'
// own libraries, so a test's image is what any other program would write).
#pragma once

#include <cstdint>
#include <cstdio>
#include <jpeglib.h>
#include <png.h>
#include <stdexcept>
#include <string>
#include <vector>

namespace dp::test {

// `rgb`: height rows of width RGB triples.
inline void write_png(const std::string& path, int width, int height, const std::vector<std::uint8_t>& rgb) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(width);
  image.height = static_cast<png_uint_32>(height);
  image.format = PNG_FORMAT_RGB;
  if (!png_image_write_to_file(&image, path.c_str(), 0, rgb.data(), 0, nullptr))
    throw std::runtime_error("write_png " + path + ": " + image.message);
}

inline void write_jpeg(const std::string& path, int width, int height, const std::vector<std::uint8_t>& rgb,
                       int quality = 95) {
  FILE* file = std::fopen(path.c_str(), "wb");
  if (!file) throw std::runtime_error("write_jpeg: cannot open " + path);
  jpeg_compress_struct c{};
  jpeg_error_mgr error{};
  c.err = jpeg_std_error(&error);
  jpeg_create_compress(&c);
  jpeg_stdio_dest(&c, file);
  c.image_width = static_cast<JDIMENSION>(width);
  c.image_height = static_cast<JDIMENSION>(height);
  c.input_components = 3;
  c.in_color_space = JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    auto* row = const_cast<JSAMPLE*>(rgb.data() + static_cast<std::size_t>(c.next_scanline) * width * 3);
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::fclose(file);
}

}  // namespace dp::test
