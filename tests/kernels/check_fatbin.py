#!/usr/bin/env python3
"""Checks that every nvcc-compiled object holds a cubin (real device code) for each requested
architecture: extracts .nv_fatbin with objcopy and reads the SM version from each embedded ELF's
e_flags (bits 8..15, e.g. 0x50 = sm_80). Usage: check_fatbin.py "80;90" OBJECT_DIR (all *.cu.o below it)"""
import pathlib
import struct
import subprocess
import sys
import tempfile


def cubin_archs(obj):
    with tempfile.NamedTemporaryFile() as out:
        subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", obj, out.name], check=True)
        data = open(out.name, "rb").read()
    archs, i = set(), data.find(b"\x7fELF")
    while i >= 0:
        e_flags = struct.unpack_from("<I", data, i + 48)[0]
        archs.add((e_flags >> 8) & 0xFF)
        i = data.find(b"\x7fELF", i + 4)
    return archs


def main():
    wanted = {int(a.split("-")[0]) for a in sys.argv[1].replace(",", ";").split(";") if a}
    bad = 0
    objects = sorted(str(p) for p in pathlib.Path(sys.argv[2]).rglob("*.cu.o"))
    for obj in objects:
        got = cubin_archs(obj)
        missing = wanted - got
        print(f"{obj}: sm_{', sm_'.join(str(a) for a in sorted(got)) or 'none'}")
        if missing:
            print(f"  MISSING: {sorted(missing)}")
            bad += 1
    return 1 if bad or not objects else 0


if __name__ == "__main__":
    sys.exit(main())
