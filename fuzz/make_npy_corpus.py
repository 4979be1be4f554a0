"""Writes the seed corpus of fuzz_npy with NumPy: small files it accepts and a few it must
reject (other dtypes, big-endian, Fortran order). Run by `scripts/fuzz corpus`:

    /usr/bin/python3 fuzz/make_npy_corpus.py OUT_DIR
"""
import io
import os
import sys

import numpy as np


def save(out_dir, name, array, version=None):
    buf = io.BytesIO()
    if version is None:
        np.save(buf, array, allow_pickle=False)
    else:
        np.lib.format.write_array(buf, array, version=version, allow_pickle=False)
    with open(os.path.join(out_dir, name), "wb") as f:
        f.write(buf.getvalue())


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_npy_corpus.py OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    special = np.array([0.0, -0.0, 1e-45, 1e30, np.finfo(np.float32).max, np.nan, np.inf, -np.inf])
    save(out, "f32_2x3.npy", np.arange(6, dtype="<f4").reshape(2, 3) / 4)
    save(out, "f64_5.npy", np.linspace(-1, 1, 5).astype("<f8"))
    save(out, "f64_scalar.npy", np.array(42.5, dtype="<f8"))
    save(out, "f32_empty_0x4.npy", np.zeros((0, 4), dtype="<f4"))
    save(out, "f32_2x1x3.npy", np.ones((2, 1, 3), dtype="<f4"))
    save(out, "f32_special.npy", special.astype("<f4"))
    save(out, "f64_special.npy", np.append(special, 5e-324).astype("<f8"))
    save(out, "f64_v2.npy", np.eye(2, dtype="<f8"), version=(2, 0))
    save(out, "f32_v3.npy", np.full((3,), 0.5, dtype="<f4"), version=(3, 0))
    save(out, "f16_2x3.npy", (np.arange(6, dtype="<f2").reshape(2, 3) / 4).astype("<f2"))
    with np.errstate(over="ignore"):  # the large values become infinities, as meant
        save(out, "f16_special.npy", np.append(special, 6e-8).astype("<f2"))
    # Rejected: the reader supports only little-endian float16 / float32 / float64 in C order.
    save(out, "reject_i4.npy", np.arange(3, dtype="<i4"))
    save(out, "reject_big_endian.npy", np.arange(3, dtype=">f4"))
    save(out, "reject_fortran.npy", np.asfortranarray(np.ones((2, 3), dtype="<f8")))


if __name__ == "__main__":
    main()
