import sys

from vllm_amphista.train.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
