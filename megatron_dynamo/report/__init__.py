"""``dynamo report``: one page (PNG + self-contained HTML) of a DynaMO run's curves, several runs overlaid.

``runs`` reads run directories and ``dynamo compare`` directories (files only, nothing of the trainer);
``page`` draws the panels and writes report.png, report.html and report.json.
"""
