"""What the routes run in a solver worker process: plan, estimate, replan, detect and render a stored plan,
each from wire models to an answer ready to send. Also what the CLI calls to plan without a server."""
