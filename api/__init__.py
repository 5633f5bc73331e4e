"""The HTTP boundary: FastAPI app, wire models, settings, plan store."""
