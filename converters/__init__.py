"""Built-in converters: importing this package registers every architecture."""

from . import qwen3_moe  # noqa: F401
