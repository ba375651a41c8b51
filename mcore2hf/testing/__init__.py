"""Test support shipped with the library (the demo uses it too): CPU shims, gloo worlds, tiny models, TE naming."""
