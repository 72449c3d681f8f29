-- Intake rejections are kept per publisher, the newest first (core::jobs, KEPT_INTAKE_REJECTIONS):
-- a tenant publishing messages the intake cannot read must not grow this table without bound.
-- Messages without a broker-vouched publisher are one group ('').
CREATE INDEX intake_rejections_publisher ON intake_rejections ((COALESCE(publisher, '')), id);
