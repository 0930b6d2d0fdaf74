#!/usr/bin/python3
"""Golden outputs of torchvision 0.14's transforms on float images, for dp's (dp/io/transforms.h),
in tests/golden/transforms.safetensors; each case's parameters are a JSON string in the metadata
under the case's name.

- crop<k>: RandomResizedCrop.get_params on an image of (height, width) with (scale, ratio), run with
  torch's generator seeded k; the float32 values uniform_ returned and the ints randint returned are
  recorded as torch drew them (`.uniforms` F32, `.randints` I64, absent when none) with the box (top, left, height,
  width) get_params chose (`.box` I64). dp replays the draws and must choose the same box.
- resized<k>: F.resized_crop(image, top, left, height, width, size, BILINEAR, antialias=False) of
  the float image (`image.float`, ToTensor of `image.u8`): `.out` F32 (3, size[0], size[1]).
- hflip: F.hflip(image.float).
- eval<k>: Resize(resize, antialias=False) then CenterCrop(crop) of image.float (`.out`), and the
  size Resize chose (`.resized` I64 [height, width]).
- normalize: F.normalize(image.float, ImageNet mean, std).
- train<k>: the whole training pipeline, Compose([ToTensor(), RandomResizedCrop(size,
  antialias=False), RandomHorizontalFlip(), Normalize(mean, std)]) on `<image>.u8` with torch
  seeded 100 + k: what it drew (`.uniforms`, the flip's torch.rand last; `.randints`) and `.out`.
The same for `tall.*` (a portrait image), for the eval and resized cases that name it.

Run with Debian's python3-torch and python3-torchvision:
    /usr/bin/python3 tests/golden/make_transform_goldens.py
"""
import json
import os

import numpy as np
import torch
import torchvision
import torchvision.transforms as T
import torchvision.transforms.functional as F

from make_goldens import encode_safetensors  # the one safetensors writer of the golden scripts

torch.set_num_threads(1)
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def make_image(height, width, seed):
    # Smooth gradients plus noise: interpolation errors show at every pixel, and the noise makes
    # a transposed or shifted sample visible.
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    pixels = (base + rng.integers(-40, 41, size=base.shape)).clip(0, 255).astype(np.uint8)
    return torch.from_numpy(pixels)  # (H, W, 3), as np.asarray(PIL image)


def to_float(pixels):
    return F.to_tensor(pixels.numpy())  # (3, H, W) in [0, 1]: uint8 / 255 in float32


def recorded(run, seed):
    """run() as torchvision runs it, with torch seeded `seed` and what it drew recorded: the values
    of uniform_ and rand (in order), and those of randint."""
    uniforms, randints = [], []
    real_uniform, real_rand, real_randint = torch.Tensor.uniform_, torch.rand, torch.randint

    def recording(real, into):
        def draw(*args, **kwargs):
            out = real(*args, **kwargs)
            into.append(out.item())
            return out
        return draw

    torch.manual_seed(seed)
    torch.Tensor.uniform_ = recording(real_uniform, uniforms)
    torch.rand, torch.randint = recording(real_rand, uniforms), recording(real_randint, randints)
    try:
        result = run()
    finally:
        torch.Tensor.uniform_, torch.rand, torch.randint = real_uniform, real_rand, real_randint
    return uniforms, randints, result


def recorded_get_params(height, width, scale, ratio, seed):
    """RandomResizedCrop.get_params as torchvision runs it, with what torch drew recorded."""
    return recorded(lambda: T.RandomResizedCrop.get_params(torch.zeros(3, height, width), scale, ratio), seed)


# (height, width, scale, ratio) of the crop cases; torch's generator is seeded with the case's index.
DEFAULT = ((0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0))
CROP_CASES = ([(37, 53) + DEFAULT] * 48 + [(224, 224) + DEFAULT] * 8 + [(500, 375) + DEFAULT] * 8 +
              [(61, 29, (0.5, 1.0), (0.5, 2.0))] * 8 +
              # Mostly or always no fit in 10 attempts: the fallback's three branches.
              [(10, 100, (0.9, 1.0), DEFAULT[1])] * 2 + [(100, 10, (0.9, 1.0), DEFAULT[1])] * 2 +
              [(37, 53, (1.5, 2.0), DEFAULT[1])] * 2 + [(40, 50, (1.5, 2.0), (0.5, 2.0))] * 2)

# (image, top, left, height, width, out height, out width)
RESIZED_CASES = [("image", 5, 7, 20, 30, 24, 24), ("image", 0, 0, 37, 53, 24, 24), ("image", 0, 0, 37, 53, 37, 53),
                 ("image", 3, 2, 9, 11, 32, 32), ("image", 36, 52, 1, 1, 4, 4), ("image", 10, 1, 25, 40, 17, 31),
                 ("image", 1, 4, 30, 13, 45, 40), ("tall", 0, 3, 61, 20, 16, 16)]

# (image, resize, crop): the shorter side to `resize`, then the centre crop (padded with 0 when larger)
EVAL_CASES = [("image", 32, 24), ("image", 40, 24), ("image", 20, 24), ("image", 37, 37), ("image", 29, 29),
              ("tall", 32, 24), ("tall", 29, 24), ("tall", 18, 21)]

# (image, size): the training pipeline's cases, torch seeded 100 + k.
TRAIN_CASES = [("image", 20)] * 6 + [("tall", 16)] * 4


def main():
    images = {"image": make_image(37, 53, 1), "tall": make_image(61, 29, 2)}
    floats = {name: to_float(pixels) for name, pixels in images.items()}
    tensors, meta = {}, {"torch": torch.__version__, "torchvision": torchvision.__version__}
    for name in images:
        tensors[f"{name}.u8"] = images[name]
        tensors[f"{name}.float"] = floats[name]
    tensors["log_ratio"] = torch.log(torch.tensor(DEFAULT[1]))  # what get_params draws the log-aspect between

    for k, (height, width, scale, ratio) in enumerate(CROP_CASES):
        uniforms, randints, box = recorded_get_params(height, width, scale, ratio, k)
        tensors[f"crop{k}.uniforms"] = torch.tensor(uniforms, dtype=torch.float32)
        if randints:  # none when no attempt fitted (the fallback); dp's reader refuses empty tensors
            tensors[f"crop{k}.randints"] = torch.tensor(randints, dtype=torch.int64)
        tensors[f"crop{k}.box"] = torch.tensor(box, dtype=torch.int64)
        meta[f"crop{k}"] = json.dumps({"height": height, "width": width, "scale": scale, "ratio": ratio})

    for k, (image, top, left, height, width, out_h, out_w) in enumerate(RESIZED_CASES):
        out = F.resized_crop(floats[image], top, left, height, width, [out_h, out_w],
                             T.InterpolationMode.BILINEAR, antialias=False)
        tensors[f"resized{k}.out"] = out.contiguous()
        meta[f"resized{k}"] = json.dumps({"image": image, "box": [top, left, height, width], "size": [out_h, out_w]})

    tensors["hflip"] = F.hflip(floats["image"]).contiguous()

    for k, (image, resize, crop) in enumerate(EVAL_CASES):
        resized = T.Resize(resize, interpolation=T.InterpolationMode.BILINEAR, antialias=False)(floats[image])
        tensors[f"eval{k}.resized"] = torch.tensor(resized.shape[1:], dtype=torch.int64)
        tensors[f"eval{k}.out"] = T.CenterCrop(crop)(resized).contiguous()
        meta[f"eval{k}"] = json.dumps({"image": image, "resize": resize, "crop": crop})

    tensors["normalize"] = F.normalize(floats["image"], MEAN, STD)
    meta["normalize"] = json.dumps({"mean": MEAN, "std": STD})

    for k, (image, size) in enumerate(TRAIN_CASES):
        pipeline = T.Compose([T.ToTensor(), T.RandomResizedCrop(size, antialias=False), T.RandomHorizontalFlip(),
                              T.Normalize(MEAN, STD)])
        uniforms, randints, out = recorded(lambda: pipeline(images[image].numpy()), 100 + k)
        tensors[f"train{k}.uniforms"] = torch.tensor(uniforms, dtype=torch.float32)
        tensors[f"train{k}.randints"] = torch.tensor(randints, dtype=torch.int64)
        tensors[f"train{k}.out"] = out.contiguous()
        meta[f"train{k}"] = json.dumps({"image": image, "size": size, "mean": MEAN, "std": STD})

    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transforms.safetensors")
    with open(out, "wb") as f:
        f.write(encode_safetensors(tensors, meta))
    print(f"wrote {out} ({len(tensors)} tensors; torch {torch.__version__}, torchvision {torchvision.__version__})")


if __name__ == "__main__":
    main()
