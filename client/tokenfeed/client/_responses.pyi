# Types of the C extension (_responses.c); responses.py documents the function.
from typing import Any

def scan(
    data: Any, /
) -> tuple[list[tuple[Any, ...]], bytearray, int, tuple[int, int] | None] | None: ...
