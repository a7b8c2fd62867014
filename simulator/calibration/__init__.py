"""Calibration of the cost model: one fitter and one report for every source of
measurements.

- :mod:`~pipedsl.simulator.calibration.fitter`: the cluster numbers at which the
  simulator prices calibration steps as measured (least squares, or a grid);
- :mod:`~pipedsl.simulator.calibration.report`: each parameter with the measurement
  behind it, and how well the fit reproduces each calibration step;
- :mod:`~pipedsl.simulator.calibration.machine`: a machine's measurements (what
  ``pipedsl calibrate`` times there) fitted into a :class:`~pipedsl.simulator.Cluster`;
- :mod:`~pipedsl.simulator.calibration.timelines`: recorded timelines fitted into a
  :class:`~pipedsl.simulator.CostModel`;
- published runs: :mod:`pipedsl.simulator.fit_published` (``python -m
  pipedsl.simulator.fit_published``), on the same fitter.

Nothing here imports JAX: the measurements are taken by the CLI, which hands their
seconds over.
"""
