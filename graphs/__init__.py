"""Decode-step capture per batch bucket (installed as `inkling_compiled.graphs`)."""
