# Hooks testbed's pytest plugin in, so `pytest --device=NAME` works from the checkout.
pytest_plugins = ["testbed.pytest_plugin", "pytester"]
