"""pddlink.sim"""
