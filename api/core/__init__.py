"""What the HTTP service stands on besides its routes: settings, the plan store, the solver worker pool and
its admission control, body limits, auth and view links, request logs and metrics."""
