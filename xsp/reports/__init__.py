"""Presenting analyses: terminal tables (and, later, HTML). The only place that formats output."""
