"""Builds the data of examples/two_towers.df from Debian's `fortunes` (Python's standard
library only): each fortune of four files is a ticket whose department is its file, whose
priority is whether it is attributed (a line starting with `--`), whose title is its first 16
bytes and body its first 128 (zero-padded), and whose tags say which of 12 words it holds.
Writes .npy files, train_*.npy and test_* (every seventh fortune), to the directory given.

    python3 examples/two_towers_data.py OUT_DIR [FORTUNES_DIR]
"""
import os
import struct
import sys

DEPARTMENTS = ["computers", "science", "politics", "work"]
TAGS = ["computer", "program", "system", "money", "time", "law", "war", "people", "life", "work", "man", "never"]
TITLE, BODY = 16, 128


def save_npy(path, descr, shape, values):
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (
        descr, "".join(f"{d}, " for d in shape) if len(shape) == 1 else ", ".join(map(str, shape)))
    header = header.ljust(117) + "\n"
    code = {"<i4": "i", "<f4": "f"}[descr]
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin-1"))
        f.write(struct.pack(f"<{len(values)}{code}", *values))


def tokens(text, length):
    data = text.encode("utf-8", "replace")[:length]
    return list(data) + [0] * (length - len(data))


def main():
    out = sys.argv[1]
    source = sys.argv[2] if len(sys.argv) > 2 else "/usr/share/games/fortunes"
    os.makedirs(out, exist_ok=True)
    tickets = []
    for department, name in enumerate(DEPARTMENTS):
        with open(os.path.join(source, name), encoding="utf-8", errors="replace") as f:
            for fortune in f.read().split("\n%\n"):
                if fortune.strip():
                    tickets.append((fortune, department))
    splits = {"train": [t for i, t in enumerate(tickets) if i % 7], "test": [t for i, t in enumerate(tickets) if i % 7 == 0]}
    for split, rows in splits.items():
        n = len(rows)
        title, body, tags, priority, department = [], [], [], [], []
        for text, dept in rows:
            attributed = any(line.strip().startswith("--") for line in text.splitlines())
            words = text.lower()
            title += tokens(text, TITLE)
            body += tokens(text, BODY)
            tags += [1.0 if word in words else 0.0 for word in TAGS]
            priority.append(1.0 if attributed else 0.0)
            department.append(dept)
        save_npy(f"{out}/{split}_title.npy", "<i4", (n, TITLE), title)
        save_npy(f"{out}/{split}_body.npy", "<i4", (n, BODY), body)
        save_npy(f"{out}/{split}_tag_bits.npy", "<f4", (n, len(TAGS)), tags)
        save_npy(f"{out}/{split}_priority.npy", "<f4", (n,), priority)
        save_npy(f"{out}/{split}_department.npy", "<i4", (n,), department)
        print(f"{split}: {n} tickets", file=sys.stderr)


if __name__ == "__main__":
    main()
