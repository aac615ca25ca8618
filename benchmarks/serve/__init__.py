"""`flint-sched bench serve`: load-test any OpenAI-compatible endpoint, in the manner of `vllm bench serve`.

datasets builds the requests, load sends them (arrivals, concurrency, timing), metrics does the arithmetic,
report prints and saves it, main holds the flags and `run`.
"""
