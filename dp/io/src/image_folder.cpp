// image_folder.cpp — torchvision's ImageFolder listing (find_classes, make_dataset) and the
// per-sample decode and transform.
#include "dp/io/image_folder.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fmt/format.h>
#include <iterator>
#include <set>
#include <string>
#include <sys/stat.h>
#include <utility>

#include "dp/io/image.h"
#include "dp/runtime/error.h"

namespace dp {
namespace {

namespace fs = std::filesystem;

// torchvision's IMG_EXTENSIONS, split into what dp decodes and what it does not.
constexpr const char* kDecoded[] = {".jpg", ".jpeg", ".png"};
constexpr const char* kNotDecoded[] = {".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"};

// name.lower().endswith(extension), for ASCII extensions.
bool has_extension(const std::string& name, const char* extension) {
  const std::size_t n = std::char_traits<char>::length(extension);
  if (name.size() < n) return false;
  for (std::size_t i = 0; i < n; ++i) {
    char c = name[name.size() - n + i];
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    if (c != extension[i]) return false;
  }
  return true;
}

template <std::size_t N>
bool has_any_extension(const std::string& name, const char* const (&extensions)[N]) {
  return std::any_of(std::begin(extensions), std::end(extensions),
                     [&](const char* e) { return has_extension(name, e); });
}

// One directory os.walk yields: its path relative to the root, and the names of what it holds that
// is not a directory.
struct WalkedDirectory {
  std::string relative;
  std::vector<std::string> files;
};

// The names in `dir`, split as os.scandir's entries split them: entry.is_dir() follows links, and
// an entry whose type cannot be read counts as a file. Returns what stopped the listing, if anything.
std::error_code list_directory(const fs::path& dir, std::vector<std::string>& subdirectories,
                               std::vector<std::string>& files) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    std::error_code type_ec;
    const bool is_directory = it->is_directory(type_ec);
    (is_directory ? subdirectories : files).push_back(it->path().filename().string());
  }
  return ec;
}

// The (device, inode) of a directory, links followed: how a link back to an ancestor is noticed.
std::pair<std::uint64_t, std::uint64_t> identity(const fs::path& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return {0, 0};
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

// os.walk(dir, followlinks=True), top-down, into `out`; `ancestors` are the directories above. A
// directory that cannot be listed is skipped, as os.walk skips it (onerror=None).
void walk(const fs::path& dir, const std::string& relative,
          std::vector<std::pair<std::uint64_t, std::uint64_t>>& ancestors, std::vector<WalkedDirectory>& out) {
  std::vector<std::string> subdirectories;
  WalkedDirectory here{relative, {}};
  list_directory(dir, subdirectories, here.files);
  out.push_back(std::move(here));
  ancestors.push_back(identity(dir));
  for (const std::string& name : subdirectories) {
    const fs::path sub = dir / name;
    if (std::find(ancestors.begin(), ancestors.end(), identity(sub)) != ancestors.end()) continue;
    walk(sub, relative + "/" + name, ancestors, out);
  }
  ancestors.pop_back();
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

void check_options(const ImageFolderOptions& options) {
  if (options.image_size <= 0 || options.resize_size <= 0)
    throw InvalidArgument(fmt::format("ImageFolder: image size {} and resize size {} must be positive",
                                      options.image_size, options.resize_size));
  if (!(options.flip_probability >= 0 && options.flip_probability <= 1))
    throw InvalidArgument(fmt::format("ImageFolder: flip probability {} is not in [0, 1]", options.flip_probability));
  for (float s : options.normalization.std)
    if (!(s != 0.0f) || !std::isfinite(s))
      throw InvalidArgument(fmt::format("ImageFolder: Normalize std {} must be finite and non-zero", s));
  const auto& crop = options.crop;
  if (!(crop.scale_min <= crop.scale_max) || !(crop.ratio_min <= crop.ratio_max) || !(crop.ratio_min > 0))
    throw InvalidArgument(
        fmt::format("ImageFolder: RandomResizedCrop scale ({}, {}) and ratio ({}, {}) must be (min, max) "
                    "pairs, the ratios positive",
                    crop.scale_min, crop.scale_max, crop.ratio_min, crop.ratio_max));
}

}  // namespace

ImageFolder::ImageFolder(const std::string& root, ImageFolderOptions options)
    : root_(root), options_(std::move(options)) {
  check_options(options_);
  while (root_.size() > 1 && root_.back() == '/') root_.pop_back();
  std::error_code ec;
  if (!fs::exists(root_, ec)) throw DataError(fmt::format("{}: no such directory", root_));
  if (!fs::is_directory(root_, ec)) throw DataError(fmt::format("{}: not a directory", root_));

  // find_classes: sorted(entry.name for entry in os.scandir(root) if entry.is_dir()).
  std::vector<std::string> top_files;
  if (const std::error_code listing = list_directory(root_, classes_, top_files))
    throw DataError(fmt::format("{}: cannot list ({})", root_, listing.message()));
  std::sort(classes_.begin(), classes_.end());
  if (classes_.empty())
    throw DataError(
        fmt::format("{}: no class folders (an image folder holds one subdirectory of images per class; "
                    "torchvision: \"Couldn't find any class folder\")",
                    root_));
  if (!options_.expected_classes.empty()) {
    const std::set<std::string> expected(options_.expected_classes.begin(), options_.expected_classes.end());
    const std::set<std::string> found(classes_.begin(), classes_.end());
    std::vector<std::string> missing, extra;
    std::set_difference(expected.begin(), expected.end(), found.begin(), found.end(), std::back_inserter(missing));
    std::set_difference(found.begin(), found.end(), expected.begin(), expected.end(), std::back_inserter(extra));
    if (!missing.empty() || !extra.empty())
      throw DataError(fmt::format("{}: its classes are not the expected {} (labels would not match): {}{}{}", root_,
                                  expected.size(), missing.empty() ? "" : "missing " + join(missing),
                                  missing.empty() || extra.empty() ? "" : "; ",
                                  extra.empty() ? "" : "not expected " + join(extra)));
  }

  // make_dataset: per class, sorted(os.walk(class folder, followlinks=True)), files sorted.
  std::vector<std::string> empty_classes;
  std::size_t not_decoded = 0;
  for (std::size_t label = 0; label < classes_.size(); ++label) {
    std::vector<WalkedDirectory> directories;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ancestors;
    walk(fs::path(root_) / classes_[label], classes_[label], ancestors, directories);
    std::sort(directories.begin(), directories.end(),
              [](const WalkedDirectory& a, const WalkedDirectory& b) { return a.relative < b.relative; });
    const std::size_t before = files_.size();
    for (WalkedDirectory& directory : directories) {
      std::sort(directory.files.begin(), directory.files.end());
      for (const std::string& name : directory.files) {
        if (has_any_extension(name, kDecoded)) {
          files_.push_back(directory.relative + "/" + name);
          labels_.push_back(static_cast<std::int32_t>(label));
        } else if (has_any_extension(name, kNotDecoded)) {
          ++not_decoded;
        }
      }
    }
    if (files_.size() == before) empty_classes.push_back(classes_[label]);
  }
  if (!empty_classes.empty())
    throw DataError(fmt::format("{}: found no valid file for the classes {}; dp reads .jpg, .jpeg and .png files{}",
                                root_, join(empty_classes),
                                not_decoded ? fmt::format(" ({} files of other image formats were skipped: .ppm, .bmp, "
                                                          ".pgm, .tif, .tiff and .webp are not decoded)",
                                                          not_decoded)
                                            : ""));
}

std::vector<std::int64_t> ImageFolder::sample_shape() const { return {3, options_.image_size, options_.image_size}; }

std::int64_t ImageFolder::label(std::size_t index) const {
  if (index >= labels_.size())
    throw InvalidArgument(fmt::format("ImageFolder {}: sample {} of {}", root_, index, labels_.size()));
  return labels_[index];
}

std::string ImageFolder::path(std::size_t index) const {
  if (index >= files_.size())
    throw InvalidArgument(fmt::format("ImageFolder {}: sample {} of {}", root_, index, files_.size()));
  return root_ == "/" ? "/" + files_[index] : root_ + "/" + files_[index];
}

void ImageFolder::fill(std::size_t index, const SampleKey& key, InputsOut to) const {
  float* out = to.features();
  const Image image = read_image(path(index));
  if (options_.transform == ImageTransform::train) {
    transforms::PhiloxDraws draws(key, index);
    transforms::train_transform(image, options_.image_size, options_.crop, options_.flip_probability,
                                options_.normalization, draws, out);
  } else {
    transforms::eval_transform(image, options_.resize_size, options_.image_size, options_.normalization, out);
  }
}

}  // namespace dp
