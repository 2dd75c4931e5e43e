"""What more than one test module needs, imported as ``tests.helpers.<name>``."""
