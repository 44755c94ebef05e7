"""Benchmarks: ``python -m epmoe.bench {comm,experts,layer,eplb} --help``.

Each benchmark module exposes ``add_arguments(parser)`` and ``main(args) -> list[dict]``;
every record carries its own baseline and ceiling measured in the same run.
"""
