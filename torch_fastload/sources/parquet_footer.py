"""A Parquet footer checked in Python before pyarrow is given it.

pyarrow's metadata accessors can abort the process on some corrupt footers (a C++ exception
thrown through a path that cannot carry it, e.g. ``row_group(r).column(j)`` with a size-statistics
histogram whose length does not match the column's levels). So the footer's Thrift compact
encoding is walked here first, with bounds on every length, and the invariants pyarrow assumes
are checked: a schema tree that adds up, one column chunk per leaf column in every row group,
each chunk of its leaf's physical type (a mismatch aborts in ``ColumnChunkMetaData``), and
level histograms of the lengths the schema's levels give. A footer that fails gets a
``ParquetFormatError`` naming the file, row group and column; pyarrow then parses only footers
that pass.
"""

from __future__ import annotations

from ..errors import ParquetFormatError

__all__ = ["check_footer"]

_MAX_DEPTH = 64
_MAX_ITEMS = 1 << 24
_PHYSICAL_TYPES = range(8)  # BOOLEAN .. FIXED_LEN_BYTE_ARRAY


class _Corrupt(Exception):
    pass


class _Reader:
    """Thrift compact protocol: a struct as {field id: value}; lists as Python lists."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Corrupt("ends inside a value")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 70:
                raise _Corrupt("a varint longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int, depth: int):
        if depth > _MAX_DEPTH:
            raise _Corrupt("nested deeper than 64")
        if kind in (1, 2):  # bool inside a list/map
            return kind == 1 if depth < 0 else self.byte() == 1
        if kind == 3:
            return self.byte()
        if kind in (4, 5, 6):
            return self.zigzag()
        if kind == 7:
            self.pos += 8
            if self.pos > len(self.data):
                raise _Corrupt("ends inside a double")
            return None
        if kind == 8:
            n = self.varint()
            if n > len(self.data) - self.pos:
                raise _Corrupt(f"a binary of {n} bytes runs past the footer")
            self.pos += n
            return self.data[self.pos - n : self.pos]
        if kind in (9, 10):
            head = self.byte()
            n, item = head >> 4, head & 0x0F
            if n == 15:
                n = self.varint()
            if n > _MAX_ITEMS or n > len(self.data) - self.pos:
                raise _Corrupt(f"a list of {n} items cannot fit in the footer")
            return [self.value(item, depth + 1) for _ in range(n)]
        if kind == 11:
            n = self.varint()
            if n > _MAX_ITEMS or n > len(self.data) - self.pos:
                raise _Corrupt(f"a map of {n} entries cannot fit in the footer")
            if n:
                kinds = self.byte()
                for _ in range(n):
                    self.value(kinds >> 4, depth + 1)
                    self.value(kinds & 0x0F, depth + 1)
            return None
        if kind == 12:
            return self.struct(depth + 1)
        raise _Corrupt(f"unknown Thrift type {kind}")

    def struct(self, depth: int = 0) -> dict:
        fields: dict = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            kind, delta = head & 0x0F, head >> 4
            field = last + delta if delta else self.zigzag()
            last = field
            if kind in (1, 2):
                fields[field] = kind == 1
            else:
                fields[field] = self.value(kind, depth)


def _leaf_levels(schema: list) -> list:
    """(path, max definition level, max repetition level, physical type) of every leaf of a
    flat schema list."""
    leaves: list = []
    position = 1

    def walk(count: int, path: tuple, dlevel: int, rlevel: int, depth: int) -> None:
        nonlocal position
        if depth > _MAX_DEPTH:
            raise _Corrupt("the schema nests deeper than 64")
        for _ in range(count):
            if position >= len(schema):
                raise _Corrupt("the schema's child counts run past its elements")
            element = schema[position]
            position += 1
            if not isinstance(element, dict):
                raise _Corrupt("a schema element is not a struct")
            repetition = element.get(3, 0)
            d = dlevel + (repetition in (1, 2))
            r = rlevel + (repetition == 2)
            name = element.get(4, b"")
            name = name.decode("utf-8", "replace") if isinstance(name, bytes) else "?"
            children = element.get(5, 0)
            if not isinstance(children, int) or children < 0 or children > len(schema):
                raise _Corrupt(f"schema element {name!r} has {children} children")
            if children:
                walk(children, path + (name,), d, r, depth + 1)
            else:
                physical = element.get(1)
                if physical not in _PHYSICAL_TYPES:
                    raise _Corrupt(f"leaf column {name!r} has physical type {physical!r}")
                leaves.append((path + (name,), d, r, physical))

    if not schema or not isinstance(schema[0], dict):
        raise _Corrupt("no schema root")
    root_children = schema[0].get(5, 0)
    if not isinstance(root_children, int) or root_children < 0:
        raise _Corrupt("the schema root's child count is not a count")
    walk(root_children, (), 0, 0, 0)
    if position != len(schema):
        raise _Corrupt(f"the schema lists {len(schema)} elements, its tree uses {position}")
    return leaves


def _check_histogram(stats, expected: int, which: int, what: str) -> None:
    histogram = stats.get(which) if isinstance(stats, dict) else None
    if histogram is not None and (not isinstance(histogram, list) or len(histogram) not in (0, expected)):
        size = len(histogram) if isinstance(histogram, list) else "?"
        raise _Corrupt(f"{what} level histogram has {size} entries, the schema's levels give {expected}")


def check_footer(path: str, footer: bytes) -> list:
    """``ParquetFormatError`` unless ``footer`` is well-formed Thrift that pyarrow can hold;
    else the top-level column that owns each leaf column, in leaf order (names may hold dots,
    so pyarrow's dotted leaf paths cannot tell)."""
    where: dict = {"row_group": None, "column": None}  # what the error names
    try:
        reader = _Reader(footer)
        meta = reader.struct()
        schema = meta.get(2)
        if not isinstance(schema, list):
            raise _Corrupt("no schema list")
        leaves = _leaf_levels(schema)
        groups = meta.get(4, [])
        if not isinstance(groups, list):
            raise _Corrupt("row groups are not a list")
        for r, group in enumerate(groups):
            where["row_group"] = r
            chunks = group.get(1) if isinstance(group, dict) else None
            if not isinstance(chunks, list) or len(chunks) != len(leaves):
                count = len(chunks) if isinstance(chunks, list) else "no"
                raise _Corrupt(f"{count} column chunks for {len(leaves)} leaf columns")
            for (names, dlevel, rlevel, physical), chunk in zip(leaves, chunks):
                where["column"] = ".".join(names)
                meta_data = chunk.get(3) if isinstance(chunk, dict) else None
                if not isinstance(meta_data, dict):
                    raise _Corrupt("a column chunk without its metadata")
                if meta_data.get(1) != physical:
                    raise _Corrupt(f"a column chunk of physical type {meta_data.get(1)!r}, its column's is {physical}")
                sizes = meta_data.get(16)
                _check_histogram(sizes, rlevel + 1, 2, "repetition")
                _check_histogram(sizes, dlevel + 1, 3, "definition")
            where["column"] = None
        where["row_group"] = None
    except _Corrupt as exc:
        raise ParquetFormatError(path, f"corrupt footer: {exc}", **where) from None
    return [leaf[0][0] for leaf in leaves]
