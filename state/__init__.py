"""state: commit / restore / sync of training state, durable checkpoints, the elastic sampler.

Uses ``elastic_ring`` only. Its contents arrive with the state issue; this
package exists now so that the distribution's layout is final.
"""
