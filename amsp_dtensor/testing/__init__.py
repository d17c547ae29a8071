"""Test helpers shipped with the package: a tiny Llama and a multi-process runner."""
