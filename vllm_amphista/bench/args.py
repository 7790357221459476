"""Method names and argument types shared by the benchmark commands."""

from __future__ import annotations

import argparse

ALL_METHODS = ("vanilla", "ngram", "anpd", "medusa", "eagle", "dflash", "amphista", "amphista_anpd")


def parse_methods(value: str) -> list[str]:
    methods = [method.strip() for method in value.split(",") if method.strip()]
    unknown = [method for method in methods if method not in ALL_METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"unknown methods {unknown}; choose from {','.join(ALL_METHODS)}")
    return methods


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number
