"""Method names and argument types shared by the benchmark commands."""

from __future__ import annotations

import argparse

from vllm_amphista.assets import SHIPPED_EAGLE_HEADS, SHIPPED_HEADS

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


# Methods that take a dir as their model, and the flag naming it: trained weights, or (anpd) answer n-grams.
DRAFTER_DIR_FLAGS = {"amphista": "heads", "amphista_anpd": "heads", "medusa": "medusa_heads",
                     "eagle": "eagle_heads", "dflash": "dflash_drafter", "anpd": "anpd_ngrams"}


def add_drafter_dir_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", default=SHIPPED_HEADS, help="Amphista heads dir (default: the shipped heads)")
    parser.add_argument("--medusa-heads", default=None,
                        help="Medusa heads dir for vLLM's medusa method (default: <target>-medusa, which "
                             "`python -m vllm_amphista.demo_target` assembles from the shipped baseline)")
    parser.add_argument("--eagle-heads", default=SHIPPED_EAGLE_HEADS,
                        help="EAGLE drafter dir for vLLM's eagle method (default: the shipped baseline)")
    parser.add_argument("--dflash-drafter", default=None,
                        help="DFlash drafter dir (`train fit --method dflash`) for vLLM's dflash method")
    parser.add_argument("--anpd-ngrams", default=None, metavar="DIR",
                        help="a dir holding answer_ngrams.npz (the shipped heads dir does) for the anpd rows' tables "
                             "to fall back on, shown as anpd+ngrams (default: none, training-free ANPD)")


def drafter_dir(args: argparse.Namespace, method: str) -> str | None:
    """The dir `method` gets as its model (flags of `add_drafter_dir_flags`), or None."""
    if method not in DRAFTER_DIR_FLAGS:
        return None
    if method == "medusa" and args.medusa_heads is None:
        return args.target.rstrip("/") + "-medusa"
    return getattr(args, DRAFTER_DIR_FLAGS[method])
