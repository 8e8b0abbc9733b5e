"""``python -m bench``: run the benchmarks and print the results table."""

from bench.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
