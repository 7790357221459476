from vllm_amphista.bench.cli import main

if __name__ == "__main__":
    main()
