"""One-pass row copies in compiled code, with the GIL released.

numpy copies rows between two scattered id lists through a temporary (two passes) and holds
the GIL throughout, so a transport thread copying under a busy engine thread keeps stopping
to take the GIL back. This loop copies each row once, straight from source to destination,
while other threads run.
Compiled when this module is first imported (cached on disk after), never during a hand-off.
numba is optional: without it, kvtransfer.rows keeps numpy's copies.
"""

from __future__ import annotations

import numba


@numba.njit("void(uint8[:, ::1], uint8[:, ::1], intp[::1], intp[::1])", cache=True, nogil=True)
def copy_row_ids(src, dst, src_ids, dst_ids):  # pragma: no cover (compiled)
    """dst[dst_ids[i]] = src[src_ids[i]]; ids already checked against both shapes."""
    width = src.shape[1]
    for i in range(src_ids.shape[0]):
        a, b = src[src_ids[i]], dst[dst_ids[i]]
        for j in range(width):
            b[j] = a[j]
