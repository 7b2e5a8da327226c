"""The step: requests are scheduled, run on the model, and post-processed into
records (schedule -> run -> postprocess), inside the `Engine`."""
