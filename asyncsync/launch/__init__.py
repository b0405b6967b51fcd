"""Servers started and stopped for the demo, the benchmarks, the tests and the examples (``reference``:
asyncsync's own in a child process; ``vllm``: a stock vLLM in a process group of its own), and the
blocking HTTP they are driven with (``http``)."""
