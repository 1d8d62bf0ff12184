"""A stranger on the trainer's weight-transfer store (tests/test_stranger.py): a process
that reaches the store's port but holds neither the run's secret nor its Redis.

``python -m tests.store_stranger HOST PORT STOP_FILE`` connects as a plain TCPStore
client and, until STOP_FILE exists (at most 300 s), over and over: lists the store's
keys, overwrites every key it did not write with garbage (short, long, and a gloo-like
length prefix claiming 2^40 bytes), and floods the store with 16 KB writes under its
own keys (500 names, rewritten). It prints one line per key it saw first
(``key <name>``) and at the end ``done garbled <n> flooded <n> seen <n>``.
"""

import datetime
import os
import struct
import sys
import time

import torch.distributed as dist

GARBAGE = [b"x", b"\x00" * 200, struct.pack("<Q", 1 << 40) + b"\xff" * 64, b"A" * 36]


def main(host: str, port: int, stop_file: str) -> None:
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
    blob = b"\xab" * 16384
    seen: set[str] = set()
    garbled = flooded = 0
    end = time.monotonic() + 300
    while time.monotonic() < end and not os.path.exists(stop_file):
        for key in store.list_keys():
            if key.startswith("stranger/"):
                continue
            if key not in seen:
                seen.add(key)
                print(f"key {key}", flush=True)
            store.set(key, GARBAGE[garbled % len(GARBAGE)])
            garbled += 1
        for _ in range(20):
            store.set(f"stranger/{flooded % 500}", blob)
            flooded += 1
    print(f"done garbled {garbled} flooded {flooded} seen {len(seen)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
