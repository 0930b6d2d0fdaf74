#!/usr/bin/python3
"""Writes Fashion-MNIST (Debian's dataset-fashion-mnist) as a torchvision ImageFolder of PNG files:
OUT/train/<class>/<index>.png and OUT/val/<class>/<index>.png, the class folders named
0_tshirt, 1_trouser, ... so that their sorted order (torchvision's) is Fashion-MNIST's label order.
Every --jpeg-every'th image is written as JPEG instead (quality 95), so both decoders are used.

    /usr/bin/python3 scripts/make_image_folder.py /tmp/fashion-folder --train 60000 --val 10000

Needs python3-pil. The images stay 28x28 greys: dp's ImageFolder converts them to RGB as
torchvision's loader (PIL's convert('RGB')) does.
"""
import argparse
import gzip
import os
import struct
import sys

from PIL import Image

CLASSES = ["0_tshirt", "1_trouser", "2_pullover", "3_dress", "4_coat", "5_sandal", "6_shirt", "7_sneaker", "8_bag",
           "9_boot"]


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = struct.unpack(">I", data[:4])[0]
    if magic == 0x803:
        n, rows, cols = struct.unpack(">III", data[4:16])
        return [data[16 + i * rows * cols:16 + (i + 1) * rows * cols] for i in range(n)], rows, cols
    n = struct.unpack(">I", data[4:8])[0]
    return list(data[8:8 + n]), 0, 0


def write_split(source, prefix, out, count, jpeg_every):
    images, rows, cols = read_idx(os.path.join(source, f"{prefix}-images-idx3-ubyte.gz"))
    labels, _, _ = read_idx(os.path.join(source, f"{prefix}-labels-idx1-ubyte.gz"))
    count = min(count, len(images))
    for c in CLASSES:
        os.makedirs(os.path.join(out, c), exist_ok=True)
    for i in range(count):
        image = Image.frombytes("L", (cols, rows), images[i])
        jpeg = jpeg_every > 0 and i % jpeg_every == jpeg_every - 1
        name = os.path.join(out, CLASSES[labels[i]], f"{i:05d}.{'jpg' if jpeg else 'png'}")
        image.save(name, quality=95) if jpeg else image.save(name)
    return count


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--source", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--train", type=int, default=60000, help="the first N training images")
    p.add_argument("--val", type=int, default=10000, help="the first N test images")
    p.add_argument("--jpeg-every", type=int, default=10, help="every K-th image as JPEG (0: none)")
    a = p.parse_args()
    if os.path.exists(a.out):
        print(f"make_image_folder: {a.out} exists; give a new directory", file=sys.stderr)
        return 2
    n_train = write_split(a.source, "train", os.path.join(a.out, "train"), a.train, a.jpeg_every)
    n_val = write_split(a.source, "t10k", os.path.join(a.out, "val"), a.val, a.jpeg_every)
    print(f"make_image_folder: {n_train} training and {n_val} validation images in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
