"""The offloaded experts' path as device data: one MoE layer's cache plan as fixed-shape tensors
(`device_plan`, `plan_kernel`) over the device's cache tables (`tables`), its fills gathered from
the mapped pool (`gather_fills`), the CPU's share through the doorbell (`cpu_doorbell`,
`doorbell_kernels`), the one-graph decode step's MoE layer (`device_step`, with `step_counts` and
`timeline`), and `OffloadedExperts`' use of them all (`path`). Nothing here is imported by this
package: the Triton modules load only beside a GPU."""
