"""Benchmarks: each module runs one measurement and writes its report under ``bench/reports``."""
