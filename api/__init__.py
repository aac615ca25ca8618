"""The HTTP layer: OpenAI-compatible server, protocol types and the async client library.

Lives in the repository's top-level `api/` and is installed as `flint_sched.api`.
"""
