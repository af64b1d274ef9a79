"""The OpenAI-compatible HTTP server: FastAPI app, streaming, metrics, auth, engine bridge."""
