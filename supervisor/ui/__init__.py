"""The operator console at /ui: pages, charts and what they read, over the control API."""
