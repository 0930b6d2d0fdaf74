// dp/io/image_folder.h — torchvision.datasets.ImageFolder: a directory with one subdirectory per
// class, its PNG and JPEG files decoded (dp/image.h) and transformed (dp/transforms.h) on demand.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dp/io/sample_source.h"
#include "dp/io/transforms.h"

namespace dp {

// Which of torchvision's ImageNet pipelines `fill` applies (dp/transforms.h has their arithmetic).
enum class ImageTransform {
  train,  // RandomResizedCrop(image_size, crop), RandomHorizontalFlip(flip_probability), Normalize
  eval,   // Resize(resize_size), CenterCrop(image_size), Normalize
};

struct ImageFolderOptions {
  ImageTransform transform = ImageTransform::train;
  int image_size = 224;                       // samples are 3 x image_size x image_size
  int resize_size = 256;                      // eval: the shorter side is resized to this before the centre crop
  transforms::Normalization normalization;    // Normalize's per-channel mean and std
  transforms::RandomResizedCropOptions crop;  // train: RandomResizedCrop's scale and ratio
  double flip_probability = 0.5;              // train: RandomHorizontalFlip's p
  // The classes the folder must hold, e.g. the training split's classes() for a validation split:
  // a missing or an extra class would silently shift the labels. Empty: not checked.
  std::vector<std::string> expected_classes;
};

// The samples torchvision's ImageFolder(root) lists, in its order:
// - classes: the names of root's subdirectories (links to directories included, hidden ones too),
//   sorted (find_classes); a class's label is its index in that order;
// - files: per class in that order, every directory under the class's folder, links followed,
//   visited in the sorted order of their paths (sorted(os.walk(..., followlinks=True))), and in
//   each its files sorted by name; a file counts when its name ends, in any case, with .jpg, .jpeg
//   or .png (torchvision's IMG_EXTENSIONS that dp decodes; .bmp, .ppm, .pgm, .tif, .tiff and .webp
//   are not). Unlike os.walk a directory that links back to one of its own ancestors is not entered
//   again (os.walk would go round until the path grows too long).
// The random draws of the train transform come from PhiloxDraws(key, index): a pure function of
// (seed, rank, epoch, sample index). fill is safe to call from several threads at once.
class ImageFolder final : public SampleSource {
 public:
  // Throws dp::DataError naming `root` and the problem: missing or not a directory, no class
  // folders, classes without any image file (named, as torchvision's "Found no valid file for the
  // classes ..."), or classes other than options.expected_classes (the missing and the extra ones
  // named); InvalidArgument for a size, std or probability out of range.
  ImageFolder(const std::string& root, ImageFolderOptions options = {});

  std::size_t size() const override { return files_.size(); }
  std::vector<std::int64_t> sample_shape() const override;
  int num_classes() const override { return static_cast<int>(classes_.size()); }
  std::int64_t label(std::size_t index) const override;
  // Decodes file `index` and transforms it; throws dp::DataError naming the file when it cannot be
  // read or decoded.
  void fill(std::size_t index, const SampleKey& key, InputsOut out) const override;

  const std::vector<std::string>& classes() const { return classes_; }
  // The path of sample `index`: root / class / ... / file.
  std::string path(std::size_t index) const;
  const std::string& root() const { return root_; }
  const ImageFolderOptions& options() const { return options_; }

 private:
  std::string root_;
  ImageFolderOptions options_;
  std::vector<std::string> classes_;
  std::vector<std::string> files_;  // relative to root_, '/'-separated, class folder first
  std::vector<std::int32_t> labels_;
};

}  // namespace dp
