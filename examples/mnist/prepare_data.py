#!/usr/bin/python3
"""Writes the four MNIST idx files that torch::data::datasets::MNIST reads
(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte,
t10k-labels-idx1-ubyte) into DIR, from gzipped idx files already on this
machine: Debian's dataset-fashion-mnist package (Fashion-MNIST: the same
format and sizes as MNIST, 60000 + 10000 28x28 images in 10 classes) by
default, or MNIST's own .gz files in --source.

    python3 examples/mnist/prepare_data.py DIR [--source DIR]

Nothing is downloaded. Exit status 2, one line on stderr, when a file is
missing or not an idx file.
"""

import argparse
import gzip
import os
import struct
import sys

FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
         "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
DEBIAN = "/usr/share/datasets/fashion-mnist"
MAGIC = {"images": 2051, "labels": 2049}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--source", default=DEBIAN,
                        help="folder with the four .gz idx files (default: "
                        "Debian's dataset-fashion-mnist, %s)" % DEBIAN)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    for name in FILES:
        src = os.path.join(args.source, name + ".gz")
        try:
            with gzip.open(src, "rb") as f:
                data = f.read()
        except OSError as e:
            sys.stderr.write("prepare_data: %s: %s (apt install "
                             "dataset-fashion-mnist)\n" % (src, e))
            return 2
        kind = "images" if "images" in name else "labels"
        if len(data) < 8 or struct.unpack(">i", data[:4])[0] != MAGIC[kind]:
            sys.stderr.write("prepare_data: %s: not an idx %s file\n" %
                             (src, kind))
            return 2
        with open(os.path.join(args.dir, name), "wb") as f:
            f.write(data)
    print("prepare_data: wrote %s" % ", ".join(
        os.path.join(args.dir, n) for n in FILES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
