// test_train_images.cpp — dp_train on a folder of PNG and JPEG photos as a torchvision user trains:
// ImageFolder classes, RandomResizedCrop/flip augmentation keyed by (seed, rank, epoch, sample),
// torchvision's ResNet-18 in every mode, its checkpoint loaded into torchvision.models.resnet18 with
// strict=True giving the accuracy dp reported, and bad image files refused naming the file.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <gtest/gtest.h>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include <zlib.h>

#include "dp/io/safetensors.h"
#include "image_files.h"
#include "test_util.h"
#include "tool_test.h"

namespace {

namespace fs = std::filesystem;
using Result = dp::test::CommandResult;

Result run(const std::string& args) { return dp::test::run_command(std::string(DP_TRAIN_BIN) + " " + args); }

class TrainImagesTest : public dp::test::ToolTest {
 protected:
  // An image of class `c`: a colour and stripe direction per class under per-image noise, `w` x `h`.
  static std::vector<std::uint8_t> picture(int c, int index, int w, int h) {
    std::vector<std::uint8_t> rgb(static_cast<std::size_t>(w) * h * 3);
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x) {
        const bool stripe = ((c == 0 ? x : c == 1 ? y : x + y) / 3) % 2 == 0;
        for (int k = 0; k < 3; ++k) {
          const int base = (k == c ? 200 : 40) + (stripe ? 40 : -20);
          const int noise = static_cast<int>((x * 7919 + y * 104729 + index * 31 + k * 13) % 41) - 20;
          rgb[(static_cast<std::size_t>(y) * w + x) * 3 + k] =
              static_cast<std::uint8_t>(std::clamp(base + noise, 0, 255));
        }
      }
    return rgb;
  }
  // DIR/train and DIR/val with classes ant, bee, cat: `train` and `val` images each, PNG and JPEG
  // alternately, of several sizes (none square), so Resize and the crops have work to do.
  std::string write_folder(const std::string& name, int train = 6, int val = 3) {
    const char* classes[] = {"ant", "bee", "cat"};
    for (const auto& [split, count] : {std::pair<std::string, int>{"train", train}, {"val", val}})
      for (int c = 0; c < 3; ++c) {
        const fs::path dir = dir_ / name / split / classes[c];
        fs::create_directories(dir);
        for (int i = 0; i < count; ++i) {
          const int w = 40 + (i % 3) * 6, h = 36 + (i % 2) * 10;
          const auto rgb = picture(c, i + (split == "val" ? 100 : 0), w, h);
          if (i % 2 == 0)
            dp::test::write_png((dir / fmt::format("img{}.png", i)).string(), w, h, rgb);
          else
            dp::test::write_jpeg((dir / fmt::format("img{}.JPG", i)).string(), w, h, rgb);
        }
      }
    return (dir_ / name).string();
  }
  static nlohmann::json last_record(const std::string& metrics, const std::string& kind) {
    std::ifstream in(metrics);
    nlohmann::json found;
    for (std::string line; std::getline(in, line);) {
      const auto record = nlohmann::json::parse(line);
      if (record.value("kind", "") == kind) found = record;
    }
    return found;
  }
  // Runs `args` with a checkpoint in place: exit 2, `message` in the output, the checkpoint untouched.
  void expect_refused(const std::string& args, const std::string& message) {
    const std::string guard = path("existing.safetensors");
    { std::ofstream(guard) << "previous checkpoint"; }
    const Result r = run(args + " --save " + guard);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << "expected '" << message << "' in:\n" << r.output;
    EXPECT_EQ(read_file(guard), "previous checkpoint") << args;
  }
};

const std::string kImageNet = "--normalize 0.485,0.456,0.406/0.229,0.224,0.225";

// A few steps in every mode from an image folder; the checkpoint loads into torchvision's resnet18
// with strict=True and gives, with the same eval transform, the validation accuracy dp reported.
TEST_F(TrainImagesTest, ResNet18TrainsInEveryModeAndTorchvisionAgrees) {
  const std::string data = write_folder("photos");
  for (const std::string mode : {"single", "dp", "ddp"}) {
    const std::string checkpoint = path(mode + ".safetensors"), metrics = path(mode + ".jsonl");
    const Result train = run(fmt::format(
        "--model resnet18 --data {} --image-size 32 --batch-size 4 --steps 2 --workers 2 --mode {} --backend sim "
        "--lr 0.01 {} --save {}",
        data, mode, kImageNet, checkpoint));
    ASSERT_EQ(train.code, 0) << train.output;
    EXPECT_NE(train.output.find("test acc"), std::string::npos) << "val/ is evaluated by default\n" << train.output;
    const dp::safetensors::File file = dp::safetensors::read(checkpoint);
    EXPECT_EQ(file.at("fc.weight").shape, (std::vector<std::int64_t>{3, 512})) << "3 class folders, 3 classes";
    EXPECT_EQ(file.metadata.at("dp.num_classes"), "3");
    EXPECT_EQ(file.metadata.at("dp.image_size"), "32");
    // The checkpoint describes its run: --eval-only needs neither the model nor the image size again.
    const std::string predictions = path(mode + ".txt");
    const Result eval =
        run(fmt::format("--eval-only --init {} --data {} --predictions {} --metrics-json {} --backend sim", checkpoint,
                        data, predictions, metrics));
    ASSERT_EQ(eval.code, 0) << eval.output;
    const nlohmann::json record = last_record(metrics, "eval");
    ASSERT_TRUE(record.contains("test_accuracy")) << eval.output;
    EXPECT_EQ(record["test_samples"], 9);
#ifdef DP_TORCHVISION_CHECK
    const Result torch = dp::test::run_command(
        fmt::format("{} {} {} {} --model resnet18 --num-classes 3 --size 32 --resize 36 --mean 0.485,0.456,0.406 "
                    "--std 0.229,0.224,0.225 --predictions {} --accuracy {:.17g}",
                    DP_PYTHON, DP_TORCHVISION_CHECK, checkpoint, data + "/val", predictions,
                    record["test_accuracy"].get<double>()));
    if (torch.code == 77) GTEST_SKIP() << torch.output;
    EXPECT_EQ(torch.code, 0) << mode << ": torchvision disagrees\n" << torch.output;
#endif
  }
}

#ifdef DP_TORCHVISION_CHECK
// A torchvision checkpoint (converted to safetensors by scripts/torchvision_to_safetensors.py)
// initialises dp strictly; with fc dropped, it fine-tunes a model of another class count with the
// backbone frozen (--init-non-strict, --freeze), as a torchvision fine-tuning recipe does.
TEST_F(TrainImagesTest, TorchvisionWeightsInitialiseAndFineTune) {
  const std::string data = write_folder("photos", 4, 1);
  const std::string script = std::string(DP_SOURCE_DIR) + "/scripts/torchvision_to_safetensors.py";
  const std::string whole = path("tv.safetensors"), backbone = path("tv_backbone.safetensors");
  const Result convert =
      dp::test::run_command(fmt::format("{} {} --random resnet18 --num-classes 3 {}", DP_PYTHON, script, whole));
  if (convert.code != 0) GTEST_SKIP() << convert.output;
  ASSERT_EQ(
      dp::test::run_command(fmt::format("{} {} --random resnet18 --drop fc {}", DP_PYTHON, script, backbone)).code, 0);
  const std::string common =
      fmt::format("--model resnet18 --data {} --image-size 32 --batch-size 4 --backend sim", data);
  const Result strict = run(fmt::format("{} --eval-only --init {}", common, whole));
  EXPECT_EQ(strict.code, 0) << "every torchvision key is dp's, and every dp key torchvision's\n" << strict.output;
  const Result refused = run(fmt::format("{} --steps 1 --init {}", common, backbone));
  EXPECT_EQ(refused.code, 2) << strict.output;
  EXPECT_NE(refused.output.find("fc.weight"), std::string::npos) << refused.output;
  const std::string tuned = path("tuned.safetensors");
  const Result tune = run(fmt::format(
      "{} --steps 2 --no-eval --init {} --init-non-strict --freeze conv1 --freeze bn1 --freeze layer1 --freeze layer2 "
      "--freeze layer3 --freeze layer4 --save {}",
      common, backbone, tuned));
  ASSERT_EQ(tune.code, 0) << tune.output;
  EXPECT_NE(tune.output.find("missing_keys=['fc.weight', 'fc.bias']"), std::string::npos) << tune.output;
  const auto before = dp::safetensors::read(backbone), after = dp::safetensors::read(tuned);
  EXPECT_EQ(before.at("layer3.1.conv2.weight").data, after.at("layer3.1.conv2.weight").data) << "frozen";
  EXPECT_EQ(before.at("conv1.weight").data, after.at("conv1.weight").data) << "frozen";
}
#endif

// The crops are drawn from (seed, rank, epoch, sample): a run resumed part-way draws what the
// uninterrupted run drew, so its checkpoint is the same bit for bit; another seed draws others.
TEST_F(TrainImagesTest, AugmentationIsReproducibleAndResumesExactly) {
  const std::string data = write_folder("photos", 4, 1);
  const std::string common = fmt::format(
      "--model resnet18 --data {} --image-size 32 --batch-size 4 --no-eval --backend sim --workers 2 --lr 0.01 {}",
      data, kImageNet);
  // 12 samples in batches of 4: 3 steps per epoch, so the resumed half starts in another epoch.
  ASSERT_EQ(run(fmt::format("{} --steps 5 --save {}", common, path("whole.safetensors"))).code, 0);
  ASSERT_EQ(run(fmt::format("{} --steps 5 --save {}", common, path("again.safetensors"))).code, 0);
  ASSERT_EQ(run(fmt::format("{} --steps 2 --save {}", common, path("half.safetensors"))).code, 0);
  const Result resumed = run(
      fmt::format("{} --steps 5 --resume {} --save {}", common, path("half.safetensors"), path("half.safetensors")));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  ASSERT_EQ(run(fmt::format("{} --steps 5 --seed 1 --save {}", common, path("other.safetensors"))).code, 0);
  const auto whole = dp::safetensors::read(path("whole.safetensors"));
  const auto again = dp::safetensors::read(path("again.safetensors"));
  const auto half = dp::safetensors::read(path("half.safetensors"));
  const auto other = dp::safetensors::read(path("other.safetensors"));
  for (const std::string name : {"conv1.weight", "layer4.1.bn2.running_var", "fc.weight"}) {
    EXPECT_EQ(whole.at(name).data, again.at(name).data) << name << ": the same run twice";
    EXPECT_EQ(whole.at(name).data, half.at(name).data) << name << ": resumed at step 2";
    EXPECT_NE(whole.at(name).data, other.at(name).data) << name << ": another seed, other crops and init";
  }
}

// Every bad image, folder or flag is refused with exit 2 naming it; nothing on disk changes.
TEST_F(TrainImagesTest, BadImagesAndFoldersAreRefusedNamingThem) {
  const std::string args = "--model resnet18 --image-size 32 --batch-size 4 --steps 2 --backend sim --data ";
  {
    const std::string data = write_folder("truncated", 2, 1);
    const std::string file = data + "/train/bee/img0.png";
    const std::string bytes = read_file(file);
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() / 2);
    expect_refused(args + data, "img0.png");
  }
  {
    const std::string data = write_folder("text", 2, 1);
    std::ofstream(data + "/train/cat/notes.jpg") << "not a picture at all";
    expect_refused(args + data, "notes.jpg");
  }
  {
    const std::string data = write_folder("empty", 2, 1);
    fs::create_directories(data + "/train/dog");
    expect_refused(args + data, "dog");
  }
  {
    const std::string data = write_folder("missing", 2, 1);
    fs::remove_all(data + "/val/cat");
    expect_refused(args + data, "cat");
  }
  {
    // A PNG header claiming 100000 x 100000 pixels: refused before anything that size is allocated.
    const std::string data = write_folder("bomb", 2, 1);
    std::string bytes = read_file(data + "/train/ant/img0.png");
    const unsigned char huge[8] = {0x00, 0x01, 0x86, 0xA0, 0x00, 0x01, 0x86, 0xA0};  // IHDR width, height
    bytes.replace(16, 8, reinterpret_cast<const char*>(huge), 8);
    // The chunk's CRC (over its type and data) made right again: only the size is wrong.
    const auto crc = static_cast<std::uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(bytes.data() + 12), 17));
    for (int k = 0; k < 4; ++k) bytes[static_cast<std::size_t>(29 + k)] = static_cast<char>(crc >> (24 - 8 * k));
    std::ofstream(data + "/train/ant/img0.png", std::ios::binary | std::ios::trunc) << bytes;
    expect_refused(args + data, "img0.png");
  }
  // 9 samples per DDP rank in batches of 4: the third step's batches hold one sample each, which a
  // training-mode BatchNorm over 1x1 planes refuses as torch's does. The error names that cause, not
  // the previous step's collectives it cut short.
  expect_refused(args + write_folder("short", 6, 1) + " --steps 3 --mode ddp",
                 "expected more than 1 value per channel");
  const std::string data = write_folder("good", 2, 1);
  expect_refused(args + data + " --normalize 0.5,0.5/0.2", "--normalize");
  expect_refused(args + data + " --model convnet", "--model convnet takes 28x28 grey images");
  expect_refused("--model resnet18 --synthetic 64 --backend sim", "trains on RGB images");
  expect_refused(args + data + " --num-classes 2", "--num-classes 2: the image folder has 3 classes");
  expect_refused("--model convnet --synthetic 64 --backend sim --normalize 0.1,0.2,0.3/0.3,0.2,0.1",
                 "the images have 1 channel");
  expect_refused("--model convnet --synthetic 64 --backend sim --image-size 64",
                 "--image-size and --resize apply to image folders");
  expect_refused("--model convnet --synthetic 64 --backend sim --num-classes 5", "--model convnet has 10 classes");
  expect_refused("--model resnet18 --backend sim --steps 1 --eval --train-dir " + data + "/train",
                 "--eval needs the image folder to evaluate on: give --val-dir");
}

// --loader-only reads the run's batches (decoded and augmented by the workers) and reports their rate.
TEST_F(TrainImagesTest, LoaderOnlyReportsTheLoadersRate) {
  const std::string data = write_folder("photos", 4, 1);
  const Result r = run(fmt::format(
      "--model resnet18 --data {} --image-size 64 --batch-size 4 --steps 6 --workers 2 --loader-only --backend sim "
      "--metrics-json {}",
      data, path("loader.jsonl")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("images/s"), std::string::npos) << r.output;
  const nlohmann::json record = last_record(path("loader.jsonl"), "loader");
  EXPECT_EQ(record["images"], 24);
  EXPECT_GT(record["images_per_s"].get<double>(), 0.0);
}

// --val-dir alone evaluates a checkpoint (--eval-only --init) and trains nothing else: without
// --eval-only it is refused at once, exit 2, naming what is missing, every file as it was (it
// crashed with SIGSEGV on the training split it did not have), in training and --loader-only alike.
TEST_F(TrainImagesTest, AValFolderWithoutATrainFolderOnlyEvaluates) {
  const std::string data = write_folder("photos", 2, 1);
  const std::string common = "--model resnet18 --image-size 32 --batch-size 4 --backend sim ";
  ASSERT_EQ(run(common + "--steps 1 --data " + data + " --save " + path("ckpt.safetensors")).code, 0);
  const auto snapshot = [&] {
    std::map<std::string, std::string> out;
    for (const auto& entry : fs::recursive_directory_iterator(dir_))
      if (entry.is_regular_file()) out[entry.path().string()] = read_file(entry.path().string());
    return out;
  };
  const std::string val = " --val-dir " + data + "/val";
  for (const std::string& flags : {std::string(), std::string(" --no-eval"), std::string(" --loader-only"),
                                   " --steps 1 --save " + path("ckpt.safetensors")}) {
    SCOPED_TRACE(flags);
    const auto before = snapshot();
    const auto t0 = std::chrono::steady_clock::now();
    const Result r = run(common + val + flags);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("--val-dir without --train-dir: training needs the folder to train on"), std::string::npos)
        << r.output;
    EXPECT_EQ(snapshot(), before);
  }
  const Result evaluated = run(common + val + " --eval-only --init " + path("ckpt.safetensors"));
  EXPECT_EQ(evaluated.code, 0) << evaluated.output;
  EXPECT_NE(evaluated.output.find("on 3 test samples"), std::string::npos) << evaluated.output;
}

}  // namespace
