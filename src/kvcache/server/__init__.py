"""The OpenAI-compatible server: ``kvcache serve`` (FastAPI on uvicorn) over the engine loop."""
