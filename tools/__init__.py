"""Benchmarks, simulators and profilers of megatron-splitkv (not part of the installed package);
`tools.benchlib` is their shared code."""
