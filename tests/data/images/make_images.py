#!/usr/bin/python3
"""Tiny image files for dp's decoder tests (tests/io/test_images.cpp) and PIL's decoding of each.

PIL writes what it can (8-bit PNGs of every colour type, JPEGs baseline, progressive, grey and
CMYK); 16-bit, interlaced and bomb PNGs are written here chunk by chunk. expected.safetensors
holds, per file, np.asarray(Image.open(file).convert("RGB")) as U8 (H, W, 3): what torchvision's
ImageFolder loader (pil_loader) hands its transforms, and what dp::read_image must return.

Run with Debian's python3-pil: /usr/bin/python3 tests/data/images/make_images.py
"""
import io
import os
import struct
import sys
import zlib

import numpy as np
import PIL
import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "golden"))
from make_goldens import encode_safetensors  # noqa: E402  the one safetensors writer of the test scripts

H, W = 6, 7  # odd width: rows are not a multiple of 4 bytes; 6 rows span two 4:2:0 MCU rows


def pattern(channels, depth=8, seed=0):
    rng = np.random.default_rng(seed)
    top = (1 << depth) - 1
    a = rng.integers(0, top + 1, size=(H, W, channels), dtype=np.int64)
    a[0, 0, :] = 0  # the extremes, where a wrong scaling shows
    a[0, 1, :] = top
    return a.astype(np.uint16 if depth == 16 else np.uint8)


def smooth(channels):
    # JPEG keeps smooth content nearly intact: the decoded pixels stay close to these.
    y, x = np.mgrid[0:16, 0:24]
    planes = [(x * 10 + 5), (y * 15), (255 - x * 5 - y * 4), (x * 3 + y * 6)]
    return np.stack(planes[:channels], axis=-1).clip(0, 255).astype(np.uint8)


def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)


def png_by_hand(array, color_type, depth, interlaced=False):
    """A PNG of `array` (H, W, C) at bit depth 2, 4, 8 or 16, filter 0 on every row."""
    height, width = array.shape[:2]
    big_endian = array.astype(">u2") if depth == 16 else array.astype(np.uint8)

    def row_bytes(row):
        if depth >= 8:
            return row.tobytes()
        values = row.reshape(-1)  # one channel: pack 8 / depth values a byte, first in the high bits
        per_byte = 8 // depth
        values = np.concatenate([values, np.zeros((-len(values)) % per_byte, np.uint8)]).reshape(-1, per_byte)
        shifts = np.arange(per_byte - 1, -1, -1) * depth
        return (values.astype(np.uint32) << shifts).sum(axis=1).astype(np.uint8).tobytes()

    def rows(sub):
        return b"".join(b"\x00" + row_bytes(sub[r]) for r in range(sub.shape[0]))

    if not interlaced:
        raw = rows(big_endian)
    else:  # Adam7: seven passes, each a small image of its own
        raw = b""
        for y0, x0, dy, dx in ((0, 0, 8, 8), (0, 4, 8, 8), (4, 0, 8, 4), (0, 2, 4, 4), (2, 0, 4, 2), (0, 1, 2, 2),
                               (1, 0, 2, 1)):
            sub = big_endian[y0::dy, x0::dx]
            if sub.size:
                raw += rows(sub)
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color_type, 0, 0, 1 if interlaced else 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def pil_bytes(image, fmt, **options):
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def files():
    rgb, grey = pattern(3, seed=1), pattern(1, seed=2)[:, :, 0]
    palette = Image.fromarray(pattern(1, seed=3)[:, :, 0] % 4, mode="P")
    palette.putpalette([10, 20, 30, 200, 100, 0, 0, 255, 128, 255, 255, 255])  # 4 colours: written at 2 bits
    yield "rgb.png", pil_bytes(Image.fromarray(rgb, "RGB"), "PNG")
    yield "grey.png", pil_bytes(Image.fromarray(grey, "L"), "PNG")
    yield "grey_1bit.png", pil_bytes(Image.fromarray(grey > 127), "PNG")
    yield "grey_4bit.png", png_by_hand(pattern(1, seed=11) % 16, 0, 4)  # libpng and PIL scale by 17
    yield "grey_2bit.png", png_by_hand(pattern(1, seed=12) % 4, 0, 2)
    yield "palette.png", pil_bytes(palette, "PNG")
    yield "palette_trns.png", pil_bytes(palette, "PNG", transparency=1)
    yield "grey_alpha.png", pil_bytes(Image.fromarray(pattern(2, seed=4), "LA"), "PNG")
    yield "rgba.png", pil_bytes(Image.fromarray(pattern(4, seed=5), "RGBA"), "PNG")
    # 16-bit: PIL reads RGB, RGBA and LA as their high bytes, but grey alone as mode "I" (0..65535),
    # which convert("RGB") clamps to 255: 0x00ff and 0x0100 both give 255, 0x0080 gives 128.
    grey16 = pattern(1, 16, seed=6)
    grey16[1, :4, 0] = [0x0080, 0x00ff, 0x0100, 0x7f00]
    yield "rgb16.png", png_by_hand(pattern(3, 16, seed=7), 2, 16)
    yield "rgba16.png", png_by_hand(pattern(4, 16, seed=8), 6, 16)
    yield "grey_alpha16.png", png_by_hand(pattern(2, 16, seed=9), 4, 16)
    yield "grey16.png", png_by_hand(grey16, 0, 16)
    yield "interlaced.png", png_by_hand(pattern(3, seed=10), 2, 8, interlaced=True)
    yield "rgb.jpg", pil_bytes(Image.fromarray(smooth(3), "RGB"), "JPEG", quality=90)
    yield "progressive.jpg", pil_bytes(Image.fromarray(smooth(3), "RGB"), "JPEG", quality=75, progressive=True)
    yield "grey.jpg", pil_bytes(Image.fromarray(smooth(1)[:, :, 0], "L"), "JPEG", quality=90)
    yield "cmyk.jpg", pil_bytes(Image.fromarray(smooth(4), "CMYK"), "JPEG", quality=90)


def bombs(jpeg):
    # Headers claiming 100000 x 100000 pixels (PNG) and 65000 x 65000 (JPEG): far over PIL's limit of
    # 2 * 89478485 pixels, with hardly any data behind them.
    ihdr = struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0)
    yield "bomb.png", (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) +
                       chunk(b"IEND", b""))
    sof = jpeg.index(b"\xff\xc0")  # baseline SOF0: length(2) precision(1) height(2) width(2)
    yield "bomb.jpg", jpeg[:sof + 5] + struct.pack(">HH", 65000, 65000) + jpeg[sof + 9:]


def main():
    written = dict(files())
    written.update(bombs(written["rgb.jpg"]))
    expected = {}
    for name, data in written.items():
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(data)
        if not name.startswith("bomb"):
            expected[name] = np.ascontiguousarray(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    tensors = {name: torch.from_numpy(pixels.copy()) for name, pixels in expected.items()}
    with open(os.path.join(HERE, "expected.safetensors"), "wb") as f:
        f.write(encode_safetensors(tensors, {"pil": PIL.__version__}))
    print(f"wrote {len(written)} files and expected.safetensors to {HERE}")


if __name__ == "__main__":
    main()
