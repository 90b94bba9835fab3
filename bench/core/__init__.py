"""Shared pieces of the benchmark suites: step timing, FLOP and MFU conventions, environment capture and the NCCL
policy, the result schema, device helpers and output formatting."""
