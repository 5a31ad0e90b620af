"""The Gradio demo (``aiayn demo``): translate, inspect and compare backends in the browser.

``demo.engine`` computes (backends, requests, comparison) without Gradio; ``demo.app`` lays
it out as a page; ``demo.cli`` is the command line.
"""
