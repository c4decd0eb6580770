"""The report: what people open in the morning and programs read.

  build            `testbed report`: one self-contained folder (HTML, Markdown, JSON) from stored
                   records, a green/amber/red verdict per device on top, templates/ for its pages
  plots            the report's plots (matplotlib PNGs)
  tables           DataFrames rendered for people (Markdown) and programs (CSV, JSON, JSON lines); a
                   leaf every command prints its tables with
  implementations  what a figure is of (device, backend, model): what a table or plot never mixes; a
                   leaf too
  junit            verdicts as JUnit XML, the file CI tools read (`run`, `sweep`, `nightly` --junit FILE)

build and plots may use everything below the lab (experiments, measure, results); tables and
implementations use nothing of testbed (tests/test_layering.py).
"""


def __getattr__(name: str):
    # testbed.report was a module before issue 26; what it held is testbed.report.build
    from testbed import _moved

    return _moved.package_attribute(__name__, name)
